//! `amber`, the user's command: resolve a reference, boot a microVM, exec/cp/run,
//! receipts and reproduce.
//!
//! Status: not built yet; tracked by the runner issue (#4).
