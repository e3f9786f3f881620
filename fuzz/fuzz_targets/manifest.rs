//! Manifest and index parsing as a manifest PUT sees it: the first byte picks the
//! Content-Type the client sent, the rest is the body. Any input gets Ok or a
//! `ManifestError` saying why (which the registry answers with 400), never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

const TYPES: [Option<&str>; 6] = [
    None,
    Some("application/vnd.oci.image.manifest.v1+json"),
    Some("application/vnd.oci.image.index.v1+json"),
    Some("application/vnd.docker.distribution.manifest.v2+json"),
    Some("application/vnd.docker.distribution.manifest.list.v2+json"),
    Some("text/plain"),
];

fuzz_target!(|data: &[u8]| {
    let Some((&first, body)) = data.split_first() else {
        return;
    };
    let content_type = TYPES[first as usize % TYPES.len()];
    if let Err(e) = amber_oci::manifest::parse_manifest(body, content_type) {
        assert!(!e.0.is_empty(), "a refused manifest names why");
    }
});
