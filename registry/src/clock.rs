//! Wall-clock time as the registry records it: whole seconds since the Unix epoch.

use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds since the Unix epoch (0 on a clock set before it).
pub fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
