//! `kerf status --from FILE`: a [`Snapshot`] read from YAML or JSON files instead of a
//! cluster — `kerf demo`'s `claims.yaml` with `kerf inventory`'s slices, or saved
//! `kubectl get resourceslices,resourceclaims -A -o yaml` output.

use std::path::Path;

use anyhow::{Context as _, bail};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use serde_json::Value;

use super::model::Snapshot;

/// Reads every ResourceSlice and ResourceClaim of `paths` (multi-document YAML or JSON; a
/// `List` contributes its items). Objects of other kinds are skipped.
///
/// # Errors
/// A file cannot be read or is not YAML, or a ResourceSlice or ResourceClaim in it does not
/// decode (the error names the file and the object).
pub fn read(paths: &[impl AsRef<Path>]) -> anyhow::Result<Snapshot> {
    let mut snapshot = Snapshot::default();
    for path in paths {
        let path = path.as_ref();
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let documents: Vec<Value> = serde_saphyr::from_multiple(&text)
            .with_context(|| format!("{}: invalid YAML", path.display()))?;
        for document in documents {
            add(&mut snapshot, document, path)?;
        }
    }
    Ok(snapshot)
}

fn add(snapshot: &mut Snapshot, document: Value, path: &Path) -> anyhow::Result<()> {
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
    let context = || format!("{}: {kind} {name:?}", path.display());
    match kind.as_str() {
        "ResourceSlice" => snapshot
            .slices
            .push(serde_json::from_value::<ResourceSlice>(document).with_context(context)?),
        "ResourceClaim" => snapshot
            .claims
            .push(serde_json::from_value::<ResourceClaim>(document).with_context(context)?),
        kind if kind.ends_with("List") => match document.get("items") {
            Some(Value::Array(items)) => {
                for item in items.clone() {
                    add(snapshot, item, path)?;
                }
            }
            Some(_) => bail!("{}: {kind}: items is not a list", path.display()),
            None => {}
        },
        // Documents of other kinds (classes, pods) sit in the same manifests.
        _ => {}
    }
    Ok(())
}
