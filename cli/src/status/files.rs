//! `kerf status --from FILE`: a [`Snapshot`] read from YAML or JSON files instead of a
//! cluster — `kerf demo`'s `claims.yaml` with `kerf inventory`'s slices, or saved
//! `kubectl get resourceslices,resourceclaims,nodes -A -o yaml` output. Nodes are optional:
//! without them, every node is in the pool `unlabeled`.

use std::path::Path;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kerf_api::gpuquota::GpuQuota;
use serde_json::Value;

use super::model::Snapshot;
use crate::error::{Error, Result};

/// Reads every ResourceSlice, ResourceClaim, GpuQuota and Node of `paths` (multi-document YAML
/// or JSON; a `List` contributes its items). Objects of other kinds are skipped.
///
/// # Errors
/// [`Error::Io`] when a file cannot be read; [`Error::Yaml`] when one is not YAML, or a
/// ResourceSlice, ResourceClaim, GpuQuota or Node in it does not decode (the error names the
/// file and the object).
pub fn read(paths: &[impl AsRef<Path>]) -> Result<Snapshot> {
    let mut snapshot = Snapshot::default();
    for path in paths {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io("reading", path, e))?;
        let documents: Vec<Value> = serde_saphyr::from_multiple(&text)
            .map_err(|e| Error::Yaml(format!("{}: invalid YAML: {e}", path.display())))?;
        for document in documents {
            add(&mut snapshot, document, path)?;
        }
    }
    Ok(snapshot)
}

fn add(snapshot: &mut Snapshot, document: Value, path: &Path) -> Result<()> {
    let kind = document
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned();
    let name = document
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned();
    let invalid =
        |e: serde_json::Error| Error::Yaml(format!("{}: {kind} {name:?}: {e}", path.display()));
    match kind.as_str() {
        "ResourceSlice" => snapshot
            .slices
            .push(serde_json::from_value::<ResourceSlice>(document).map_err(invalid)?),
        "ResourceClaim" => snapshot
            .claims
            .push(serde_json::from_value::<ResourceClaim>(document).map_err(invalid)?),
        "GpuQuota" => snapshot
            .quotas
            .push(serde_json::from_value::<GpuQuota>(document).map_err(invalid)?),
        "Node" => snapshot
            .nodes
            .push(serde_json::from_value::<Node>(document).map_err(invalid)?),
        kind if kind.ends_with("List") => match document.get("items") {
            Some(Value::Array(items)) => {
                for item in items.clone() {
                    add(snapshot, item, path)?;
                }
            }
            Some(_) => {
                return Err(Error::Yaml(format!(
                    "{}: {kind}: items is not a list",
                    path.display()
                )));
            }
            None => {}
        },
        // Documents of other kinds (classes, pods) sit in the same manifests.
        _ => {}
    }
    Ok(())
}
