//! The request and response types of amber's HTTP APIs, one definition for the server
//! that answers and the client that reads, so neither builds or picks apart JSON by hand.
//!
//! Modules: `registry` (the registry's `/amber/v1`: resolve, envs, chunks), `node`
//! (amberd's `/v1`: sandboxes, commands, files, the node).

pub mod node;
pub mod registry;
