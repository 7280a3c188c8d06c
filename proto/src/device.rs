//! The prepared device: what a DRA plugin answers for each device of a claim and what the
//! kubelet records, one type for both sides and both API versions.

use crate::dra::{v1, v1beta1};

/// One prepared device, as the plugin returns it in `NodePrepareResources` and the kubelet
/// stores it for the claim.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PreparedDevice {
    /// Requests of the claim this device serves (subrequest suffixes stripped).
    pub request_names: Vec<String>,
    /// Pool of the device (kerf's pools are named after the node).
    pub pool_name: String,
    /// Device name within the pool.
    pub device_name: String,
    /// Fully qualified CDI device IDs the container runtime injects.
    pub cdi_device_ids: Vec<String>,
    /// Share ID of a consumable-capacity allocation, when any; v1 only (v1beta1 has no
    /// such field, so it is always `None` there).
    pub share_id: Option<String>,
}

impl From<v1::Device> for PreparedDevice {
    fn from(d: v1::Device) -> Self {
        PreparedDevice {
            request_names: d.request_names,
            pool_name: d.pool_name,
            device_name: d.device_name,
            cdi_device_ids: d.cdi_device_ids,
            share_id: d.share_id,
        }
    }
}

impl From<PreparedDevice> for v1::Device {
    fn from(d: PreparedDevice) -> Self {
        v1::Device {
            request_names: d.request_names,
            pool_name: d.pool_name,
            device_name: d.device_name,
            cdi_device_ids: d.cdi_device_ids,
            share_id: d.share_id,
        }
    }
}

impl From<v1beta1::Device> for PreparedDevice {
    fn from(d: v1beta1::Device) -> Self {
        PreparedDevice {
            request_names: d.request_names,
            pool_name: d.pool_name,
            device_name: d.device_name,
            cdi_device_ids: d.cdi_device_ids,
            share_id: None,
        }
    }
}

/// v1beta1 has no `share_id`: it is dropped.
impl From<PreparedDevice> for v1beta1::Device {
    fn from(d: PreparedDevice) -> Self {
        v1beta1::Device {
            request_names: d.request_names,
            pool_name: d.pool_name,
            device_name: d.device_name,
            cdi_device_ids: d.cdi_device_ids,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(share_id: Option<&str>) -> PreparedDevice {
        PreparedDevice {
            request_names: vec!["gpu".into()],
            pool_name: "node-1".into(),
            device_name: "gpu-0".into(),
            cdi_device_ids: vec!["k8s.gpu.kerf.dev/gpu=x-gpu-0".into()],
            share_id: share_id.map(str::to_owned),
        }
    }

    #[test]
    fn v1_keeps_every_field() {
        let shared = device(Some("share-1"));
        let wire: v1::Device = shared.clone().into();
        assert_eq!(wire.share_id.as_deref(), Some("share-1"));
        assert_eq!(PreparedDevice::from(wire), shared);
    }

    #[test]
    fn v1beta1_has_no_share_id() {
        let wire: v1beta1::Device = device(Some("share-1")).into();
        assert_eq!(wire.device_name, "gpu-0");
        assert_eq!(PreparedDevice::from(wire), device(None));
    }
}
