//! The identifiers and headers a client controls: Content-Range, digests (sha256,
//! sha512, blake3 chunk and env ids), repository names, references and API paths.
#![no_main]
use amber_converter::manifest::{ChunkId, EnvDigest};
use amber_oci::digest::Digest;
use amber_oci::names::{Reference, RepoName, Route};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if let Some((start, end)) = amber_oci::names::parse_content_range(s) {
        assert!(start <= end);
    }
    if let Ok(d) = s.parse::<Digest>() {
        // What parses prints back to itself.
        assert_eq!(d.to_string().parse::<Digest>().unwrap(), d);
    }
    if let Ok(id) = s.parse::<ChunkId>() {
        assert_eq!(id.to_string().parse::<ChunkId>().unwrap(), id);
    }
    let _ = s.parse::<EnvDigest>();
    if let Ok(n) = RepoName::parse(s) {
        assert_eq!(n.as_str(), s);
    }
    let _ = Reference::parse(s);
    let _ = Route::parse(s);
});
