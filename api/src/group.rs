//! The API group and version of kerf's own types: the GpuClass custom resource and the opaque
//! parameters. A module of its own, below every other, so that the modules that name them do
//! not depend on the crate root that re-exports those modules.

/// API group of kerf's own types.
pub const GROUP: &str = "gpu.kerf.dev";
/// API version of kerf's own types.
pub const VERSION: &str = "v1alpha1";
/// `apiVersion` of kerf's own types: `gpu.kerf.dev/v1alpha1`.
pub const API_VERSION: &str = "gpu.kerf.dev/v1alpha1";
