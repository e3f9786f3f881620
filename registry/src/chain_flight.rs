//! Layer chains whose states running conversions of this process are about to keep, so
//! a conversion over the same lower layers waits for the state instead of reading those
//! layers beside it: the corpus's first images on a new base come in a burst, and five
//! conversions read one 320 MiB base layer side by side (1.3 of the 8.9 GiB of layers
//! the corpus's conversions read).
//!
//! A conversion lists the chains below its whole image whose states it keeps or may
//! keep (`convert::convert_layers`: chains an earlier image had, and chains seen first
//! here, kept when their top layer is big), from then until its states are stored or it
//! ends; a waiter then starts from whatever state was kept. A conversion waits only before it lists anything of its own, and
//! only for conversions that listed theirs before: waits cannot form a cycle.

use std::collections::HashSet;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use amber_converter::chain::ChainKey;
use tokio_util::sync::CancellationToken;

#[derive(Default)]
pub struct ChainsInFlight {
    keys: Mutex<HashSet<ChainKey>>,
    /// Notified whenever keys leave the set.
    left: Condvar,
}

/// Keys a conversion listed; they leave the set when this is dropped (states stored,
/// or the conversion failed), and the conversions waiting on them wake.
pub struct Listed {
    flight: Arc<ChainsInFlight>,
    keys: Vec<ChainKey>,
}

impl Drop for Listed {
    fn drop(&mut self) {
        let flight = &self.flight;
        let mut keys = flight.keys.lock().unwrap_or_else(|p| p.into_inner());
        for k in &self.keys {
            keys.remove(k);
        }
        flight.left.notify_all();
    }
}

impl ChainsInFlight {
    /// Lists `keys` (those no other conversion listed) until the returned guard drops.
    pub fn list(self: &Arc<Self>, keys: impl IntoIterator<Item = ChainKey>) -> Listed {
        let mut set = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        let keys = keys.into_iter().filter(|k| set.insert(*k)).collect();
        Listed {
            flight: self.clone(),
            keys,
        }
    }

    /// The longest of `keys` that a running conversion listed, as its index in `keys`.
    pub fn longest_listed(&self, keys: &[ChainKey]) -> Option<usize> {
        let set = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        keys.iter().rposition(|k| set.contains(k))
    }

    /// Waits until `key` is no longer listed, at most `limit`, and not past `stopping`.
    /// Returns whether it left the list.
    pub fn wait(&self, key: &ChainKey, stopping: &CancellationToken, limit: Duration) -> bool {
        let until = Instant::now() + limit;
        let mut set = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        while set.contains(key) {
            let now = Instant::now();
            if now >= until || stopping.is_cancelled() {
                return false;
            }
            // Woken when keys leave; a slice of at most a second notices a stop.
            let slice = (until - now).min(Duration::from_secs(1));
            set = self
                .left
                .wait_timeout(set, slice)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A waiter wakes when the conversion that listed the chain drops its listing; a
    /// chain listed twice stays with its first lister; an unlisted chain is not waited
    /// for; a chain still listed when the limit passes (or the registry stops) is not
    /// waited for past it.
    #[test]
    fn waiters_wake_when_the_listing_conversion_ends() {
        let flight = Arc::new(ChainsInFlight::default());
        let stopping = CancellationToken::new();
        let (a, b, c) = (ChainKey([1; 32]), ChainKey([2; 32]), ChainKey([3; 32]));
        let first = flight.list([a, b]);
        let second = flight.list([b, c]);
        assert_eq!(second.keys, vec![c], "b stays with its first lister");
        assert_eq!(flight.longest_listed(&[a, b, ChainKey([4; 32])]), Some(1));
        assert_eq!(flight.longest_listed(&[ChainKey([4; 32])]), None);
        assert!(flight.wait(&ChainKey([4; 32]), &stopping, Duration::ZERO));
        assert!(
            !flight.wait(&a, &stopping, Duration::ZERO),
            "still listed at the limit"
        );
        let waiter = {
            let (flight, stopping) = (flight.clone(), stopping.clone());
            std::thread::spawn(move || flight.wait(&b, &stopping, Duration::from_secs(3600)))
        };
        drop(first);
        assert!(waiter.join().unwrap(), "woken when the listing ended");
        assert_eq!(flight.longest_listed(&[a, b, c]), Some(2));
        stopping.cancel();
        assert!(
            !flight.wait(&c, &stopping, Duration::from_secs(3600)),
            "a stop ends the wait"
        );
        drop(second);
        assert_eq!(flight.longest_listed(&[a, b, c]), None);
    }
}
