//! Media types: the OCI and Docker ones the registry stores and the node reads, and
//! amber's own artifact types. One spelling of each, used everywhere.

pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
pub const OCI_EMPTY: &str = "application/vnd.oci.empty.v1+json";
pub const OCI_LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
pub const OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const OCI_LAYER_ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";
pub const DOCKER_LAYER_GZIP: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";
pub const DOCKER_LAYER_TAR: &str = "application/vnd.docker.image.rootfs.diff.tar";

/// The `Accept` header for an image manifest (either format).
pub const ACCEPT_IMAGE_MANIFEST: &str =
    "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json";

/// amber's block manifest, published as a referrer of the image it was converted from.
pub const BLOCK_MANIFEST_ARTIFACT: &str = "application/vnd.amber.block-manifest.v1+json";
/// The block manifest envelope as one zstd frame (the referrer's only layer).
pub const BLOCK_MANIFEST_LAYER: &str = "application/vnd.amber.block-manifest.v1+json+zstd";

/// A node's boot files in the registry's `amber/guest` repository.
pub const GUEST_ARTIFACT: &str = "application/vnd.amber.guest.v1";
pub const GUEST_VMLINUZ: &str = "application/vnd.amber.guest.vmlinuz";
pub const GUEST_MODULES: &str = "application/vnd.amber.guest.modules.v1.tar";
pub const GUEST_INITRAMFS: &str = "application/vnd.amber.guest.initramfs.v1.cpio";

/// Layers whose bytes live outside the registry (clients may not push them).
pub fn non_distributable(media_type: &str) -> bool {
    media_type.contains("nondistributable") || media_type.contains(".foreign.")
}
