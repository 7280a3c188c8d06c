//! The kubelet's gRPC APIs for DRA drivers, generated from the project's own `.proto` files.
//!
//! - [`dra::v1`] and [`dra::v1beta1`]: `DRAPlugin` (NodePrepareResources / NodeUnprepareResources).
//! - [`pluginregistration`]: the kubelet plugin registration service.
//! - [`health::v1alpha1`]: `DRAResourceHealth` (KEP-4680).
//! - [`client`]: the kubelet's side of the plugin sockets (registration, batched prepare
//!   and unprepare by the kubelet's rules, the health stream), one client for every caller.
//! - [`device`]: [`PreparedDevice`], the prepared device both sides exchange.
//! - [`dial`]: dialling the Unix sockets with the `:authority` of the client imitated.

pub mod client;
mod device;
pub mod dial;

pub use device::PreparedDevice;

/// The `gRPC service names` kerf advertises, as kubelet reads them from `supported_versions`.
pub mod service_names {
    /// DRA v1 (kubelet 1.34+).
    pub const DRA_V1: &str = "v1.DRAPlugin";
    /// DRA v1beta1 (kubelet 1.32+).
    pub const DRA_V1BETA1: &str = "v1beta1.DRAPlugin";
    /// DRA health v1alpha1.
    pub const HEALTH_V1ALPHA1: &str = "v1alpha1.DRAResourceHealth";
    /// The plugin type kubelet expects from a DRA driver.
    pub const DRA_PLUGIN_TYPE: &str = "DRAPlugin";
}

/// DRA plugin APIs.
pub mod dra {
    /// `k8s.io.kubelet.pkg.apis.dra.v1`.
    #[allow(missing_docs, clippy::pedantic, unused_qualifications)]
    pub mod v1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
    }
    /// `k8s.io.kubelet.pkg.apis.dra.v1beta1`.
    #[allow(missing_docs, clippy::pedantic, unused_qualifications)]
    pub mod v1beta1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
    }
}

/// `pluginregistration` (the upstream package has no version component).
#[allow(missing_docs, clippy::pedantic, unused_qualifications)]
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");
}

/// DRA resource health.
pub mod health {
    /// `v1alpha1` (`v1alpha1.DRAResourceHealth`).
    #[allow(missing_docs, clippy::pedantic, unused_qualifications)]
    pub mod v1alpha1 {
        tonic::include_proto!("v1alpha1");
    }
}
