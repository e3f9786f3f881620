//! Lock striping: which of `n` locks guards a key, so writes of different keys run side
//! by side and writes of one key take turns (the index's counters, the fs store's records).

/// The stripe of `key` among `n` (FNV-1a of its bytes).
pub fn stripe_of(key: &[u8], n: usize) -> usize {
    let h = key.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    });
    (h % n as u64) as usize
}
