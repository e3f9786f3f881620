//! amber's node side of storage: the chunk cache shared by all sandboxes on a node,
//! lazy block devices served over NBD, copy-on-write state, snapshot and fork.
//!
//! Status: not built yet; tracked by the runner issue (#4).
