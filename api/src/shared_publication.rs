//! The Node annotation through which kerf-controller tells a node's plugin which GPUs to publish
//! as shareable (scheduler slices) and how to cut them.
//!
//! The plugin cannot evaluate GpuClasses, so the controller decides: for every GPU recorded
//! `scheduler` in the ownership record that a Scheduler GpuClass with `slicing` selects, it writes
//! the class's slicing under the GPU's published name (`gpu-<minor>`). The plugin publishes those
//! GPUs with `allowMultipleAllocations: true` and consumable capacities, and prepares the shares
//! the scheduler allocates on them with the sharing named here.
//!
//! ```json
//! {"gpu-3":{"memoryGranularityBytes":1073741824,"defaultComputePercent":25,"maxSlicesPerGpu":8,"sharing":{"strategy":"MPS"}}}
//! ```

use std::collections::BTreeMap;

use kerf_core::sharing::Sharing;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Error, Result};
use crate::params::SharingConfig;

/// Node annotation, written by kerf-controller, naming the GPUs published as shareable.
pub const SHARED_PUBLICATION_ANNOTATION: &str = "gpu.kerf.dev/shared-publication";

/// The field path of the annotation in messages.
const ANNOTATION_PATH: &str = "metadata.annotations[\"gpu.kerf.dev/shared-publication\"]";

/// Published device name (`gpu-<minor>`) → how that GPU is sliced by the scheduler.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedPublication(pub BTreeMap<String, SharedSlicing>);

/// The slicing of one shareable GPU: [`crate::params::Slicing`] in bytes, plus the class's
/// sharing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SharedSlicing {
    /// Shares take memory in multiples of this many bytes (`Slicing.memoryGranularity`).
    pub memory_granularity_bytes: u64,
    /// Compute percent of a share that asks for memory only (`Slicing.defaultCompute`); a
    /// share gets 100 when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_compute_percent: Option<u8>,
    /// Most shares on the GPU (`Slicing.maxSlicesPerGpu`); unlimited when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_slices_per_gpu: Option<u32>,
    /// How shares run together (`GpuClassParameters.sharing`); MPS when unset, as for the
    /// controller's slices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharing: Option<SharingConfig>,
}

impl SharedSlicing {
    /// The sharing strategy shares of this GPU get: the class's, MPS when it names none.
    pub fn strategy(&self) -> Sharing {
        self.sharing.map_or(Sharing::Mps, |s| s.strategy)
    }

    /// Checks every value; `path` names this entry.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the first bad field and its value.
    pub fn validate(&self, path: &str) -> Result<()> {
        if self.memory_granularity_bytes == 0 {
            return Err(Error::config(
                format!("{path}.memoryGranularityBytes"),
                "0 is out of range: must be at least 1",
            ));
        }
        if let Some(compute) = self.default_compute_percent
            && !(1..=100).contains(&compute)
        {
            return Err(Error::config(
                format!("{path}.defaultComputePercent"),
                format!("{compute} is out of range 1-100"),
            ));
        }
        if self.max_slices_per_gpu == Some(0) {
            return Err(Error::config(
                format!("{path}.maxSlicesPerGpu"),
                "0 is out of range: must be at least 1",
            ));
        }
        if let Some(sharing) = &self.sharing {
            // Shares of one GPU run side by side; an exclusive GPU cannot hold two of them.
            if sharing.strategy == Sharing::Exclusive {
                return Err(Error::config(
                    format!("{path}.sharing.strategy"),
                    "Exclusive cannot be used for shares of a GPU: use MPS or TimeSlicing",
                ));
            }
            sharing.validate(&format!("{path}.sharing"))?;
        }
        Ok(())
    }
}

impl SharedPublication {
    /// Decodes the annotation's value.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming
    /// `metadata.annotations["gpu.kerf.dev/shared-publication"]` and the bad part: not a JSON
    /// object, an entry that does not decode (unknown field, wrong type), or a value out of
    /// range.
    pub fn parse(value: &str) -> Result<Self> {
        let object: serde_json::Map<String, Value> = serde_json::from_str(value)
            .map_err(|e| Error::config(ANNOTATION_PATH, format!("not a JSON object: {e}")))?;
        let mut gpus = BTreeMap::new();
        for (device, entry) in object {
            let path = format!("{ANNOTATION_PATH}[{device:?}]");
            if device.is_empty() {
                return Err(Error::config(path, "device name must not be empty"));
            }
            let slicing: SharedSlicing = serde_path_to_error::deserialize(entry).map_err(|e| {
                let field = e.path().to_string();
                let at = if field == "." {
                    path.clone()
                } else {
                    format!("{path}.{field}")
                };
                Error::config(at, e.into_inner().to_string())
            })?;
            slicing.validate(&path)?;
            gpus.insert(device, slicing);
        }
        Ok(SharedPublication(gpus))
    }

    /// Reads the annotation from a Node's annotations; empty when it is absent.
    ///
    /// # Errors
    ///
    /// As [`SharedPublication::parse`].
    pub fn from_annotations(annotations: Option<&BTreeMap<String, String>>) -> Result<Self> {
        annotations
            .and_then(|a| a.get(SHARED_PUBLICATION_ANNOTATION))
            .map_or_else(|| Ok(SharedPublication::default()), |v| Self::parse(v))
    }

    /// The annotation's value: compact JSON, devices sorted by name.
    pub fn to_annotation_value(&self) -> String {
        // A map of plain structs cannot fail to serialise; fall back to an empty object rather
        // than panicking.
        serde_json::to_string(&self.0).unwrap_or_else(|_| "{}".to_owned())
    }

    /// The slicing of `device`, when it is published as shareable.
    pub fn get(&self, device: &str) -> Option<&SharedSlicing> {
        self.0.get(device)
    }

    /// True when no GPU is shareable.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use kerf_core::mps::TimeSliceInterval;

    use super::*;

    const GI: u64 = 1 << 30;

    fn slicing() -> SharedSlicing {
        SharedSlicing {
            memory_granularity_bytes: GI,
            default_compute_percent: Some(25),
            max_slices_per_gpu: Some(8),
            sharing: None,
        }
    }

    #[test]
    fn renders_compact_and_sorted_and_parses_back() {
        let mut publication = SharedPublication::default();
        publication.0.insert("gpu-3".into(), slicing());
        publication.0.insert(
            "gpu-10".into(),
            SharedSlicing {
                memory_granularity_bytes: 512 << 20,
                default_compute_percent: None,
                max_slices_per_gpu: None,
                sharing: Some(SharingConfig {
                    strategy: Sharing::TimeSlicing,
                    time_slice_interval: Some(TimeSliceInterval::Long),
                    ..SharingConfig::default()
                }),
            },
        );
        let value = publication.to_annotation_value();
        assert_eq!(
            value,
            r#"{"gpu-10":{"memoryGranularityBytes":536870912,"sharing":{"strategy":"TimeSlicing","timeSliceInterval":"Long"}},"gpu-3":{"memoryGranularityBytes":1073741824,"defaultComputePercent":25,"maxSlicesPerGpu":8}}"#
        );
        assert_eq!(SharedPublication::parse(&value).unwrap(), publication);
    }

    #[test]
    fn sharing_defaults_to_mps() {
        assert_eq!(slicing().strategy(), Sharing::Mps);
    }

    #[test]
    fn absent_annotation_is_empty() {
        assert!(
            SharedPublication::from_annotations(None)
                .unwrap()
                .is_empty()
        );
        let other = BTreeMap::from([("x".to_owned(), "y".to_owned())]);
        assert!(
            SharedPublication::from_annotations(Some(&other))
                .unwrap()
                .is_empty()
        );
        let set = BTreeMap::from([(
            SHARED_PUBLICATION_ANNOTATION.to_owned(),
            r#"{"gpu-0":{"memoryGranularityBytes":1024}}"#.to_owned(),
        )]);
        let publication = SharedPublication::from_annotations(Some(&set)).unwrap();
        assert_eq!(
            publication.get("gpu-0").unwrap().memory_granularity_bytes,
            1024
        );
    }

    fn error(value: &str) -> String {
        SharedPublication::parse(value).unwrap_err().to_string()
    }

    #[test]
    fn bad_values_name_the_annotation_and_the_part() {
        let at = r#"metadata.annotations["gpu.kerf.dev/shared-publication"]"#;
        let e = error("[1]");
        assert!(e.starts_with(at) && e.contains("not a JSON object"), "{e}");
        let e = error(r#"{"gpu-0":{"memoryGranularityBytes":0}}"#);
        assert!(
            e.contains(&format!(r#"{at}["gpu-0"].memoryGranularityBytes"#))
                && e.contains("0 is out of range"),
            "{e}"
        );
        let e = error(r#"{"gpu-0":{"memoryGranularityBytes":"1Gi"}}"#);
        assert!(
            e.contains(r#"["gpu-0"].memoryGranularityBytes"#) && e.contains("1Gi"),
            "{e}"
        );
        let e = error(r#"{"gpu-0":{"memoryGranularityBytes":1,"defaultComputePercent":101}}"#);
        assert!(
            e.contains("defaultComputePercent") && e.contains("101"),
            "{e}"
        );
        let e = error(r#"{"gpu-0":{"memoryGranularityBytes":1,"maxSlicesPerGpu":0}}"#);
        assert!(e.contains("maxSlicesPerGpu"), "{e}");
        let e = error(r#"{"gpu-0":{"memoryGranularityBytes":1,"colour":"red"}}"#);
        assert!(e.contains(r#"["gpu-0"]"#) && e.contains("colour"), "{e}");
        let e = error(r#"{"gpu-0":{}}"#);
        assert!(e.contains("memoryGranularityBytes"), "{e}");
        let e =
            error(r#"{"gpu-0":{"memoryGranularityBytes":1,"sharing":{"strategy":"Exclusive"}}}"#);
        assert!(e.contains(r#"["gpu-0"].sharing.strategy"#), "{e}");
        let e = error(
            r#"{"gpu-0":{"memoryGranularityBytes":1,"sharing":{"strategy":"MPS","timeSliceInterval":"Long"}}}"#,
        );
        assert!(e.contains("sharing"), "{e}");
        let e = error(r#"{"":{"memoryGranularityBytes":1}}"#);
        assert!(e.contains("must not be empty"), "{e}");
    }
}
