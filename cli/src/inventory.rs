//! `kerf inventory`: the ResourceSlices the kubelet plugin would publish for this node.

use k8s_openapi::api::resource::v1::ResourceSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kerf_core::inventory::Inventory;

/// Builds the ResourceSlice objects the plugin publishes for `inventory` on `node_name`.
///
/// # Errors
/// The inventory breaks a ResourceSlice limit or a name is invalid.
pub fn resource_slices(
    inventory: &Inventory,
    driver: &str,
    node_name: &str,
) -> Result<Vec<ResourceSlice>, kerf_api::Error> {
    let specs = kerf_api::resource_slices(inventory, driver, node_name)?;
    Ok(specs
        .into_iter()
        .enumerate()
        .map(|(index, spec)| ResourceSlice {
            metadata: ObjectMeta {
                name: Some(kerf_api::slice_name(node_name, driver, index)),
                ..ObjectMeta::default()
            },
            spec,
        })
        .collect())
}

/// Renders slices as a multi-document YAML stream (k8s-openapi writes `apiVersion` and
/// `kind`), so the output can be fed to `kubectl apply --dry-run=server`.
///
/// # Errors
/// Serialization fails.
pub fn to_yaml(slices: &[ResourceSlice]) -> Result<String, serde_saphyr::ser::Error> {
    let mut out = String::new();
    for slice in slices {
        out.push_str("---\n");
        out.push_str(&serde_saphyr::to_string(slice)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn h100_profile_is_one_slice_of_eight_gpus() {
        let inventory = kerf_core::mock::from_spec("h100-sxm-80gb").unwrap();
        let slices = resource_slices(&inventory, "gpu.kerf.dev", "node-1").unwrap();
        assert_eq!(slices.len(), 1);
        let names: Vec<&str> = slices[0]
            .spec
            .devices
            .as_ref()
            .unwrap()
            .iter()
            .map(|d| d.name.as_str())
            .collect();
        assert_eq!(
            names,
            [
                "gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5", "gpu-6", "gpu-7"
            ]
        );
        let yaml = to_yaml(&slices).unwrap();
        assert!(yaml.contains("kind: ResourceSlice"), "{yaml}");
        assert!(yaml.contains("nodeName: node-1"), "{yaml}");
    }
}
