//! amber's block-image format and the converter from OCI images to block images.
//!
//! Owns: the EROFS writer, the chunking layout, the block manifest and the env digest
//! (see shared/DESIGN.md, "Block image format"). Pure and deterministic: no network,
//! no clock, no host paths.
//!
//! Status: not built yet; tracked by the converter issue (#3). The crate exists so the
//! workspace has the layout of DESIGN.md and the registry can depend on it.
