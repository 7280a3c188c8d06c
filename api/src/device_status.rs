//! Per-device claim status (`status.devices[]` of a ResourceClaim) for what the kubelet
//! plugin prepared: pure builders, no API calls.
//!
//! One [`AllocatedDeviceStatus`] per prepared device, keyed as upstream keys the list
//! (kubernetes/api `resource/v1/types.go`, `ResourceClaimStatus.Devices`: `+listType=map`
//! with `+listMapKey=driver`, `device`, `pool`, `shareID`), so that a server-side apply by
//! kerf's field manager owns only kerf's entries. Each entry carries a `Ready=True` condition
//! and `data`, a JSON object describing kerf's result, kept within the API server's limit
//! (`DATA_MAX_BYTES`).

use k8s_openapi::api::resource::v1::AllocatedDeviceStatus;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use kerf_core::checkpoint::DeviceRecord;
use kerf_core::enforcement::{self, Holders};
use kerf_core::mps::{MpsClient, TimeSliceInterval};
use serde_json::{Map, Value, json};

/// Largest `data` the API server accepts, in bytes of JSON:
/// `AllocatedDeviceStatusDataMaxLength` (10 Ki), checked by `validateDeviceStatus` in
/// kubernetes/kubernetes `pkg/apis/resource/validation/validation.go`.
const DATA_MAX_BYTES: usize = 10 * 1024;

/// The condition type kerf sets on every prepared device.
const READY_CONDITION: &str = "Ready";

/// The reason of the `Ready` condition of a prepared device.
const PREPARED_REASON: &str = "Prepared";

/// What kerf knows about one prepared device, beyond its checkpoint record: the facts the
/// record does not keep (the parent GPU of a MIG device, the MIG profile, the MPS client
/// directories), all read from memory at prepare time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedDeviceFacts {
    /// The checkpoint record of the device.
    pub record: DeviceRecord,
    /// UUID of the physical GPU (the MIG device's parent for a MIG device).
    pub gpu_uuid: String,
    /// The MIG profile, e.g. `1g.10gb`, for a MIG device.
    pub mig_profile: Option<String>,
    /// The MPS control daemon's directories a client of this device gets, where one serves it.
    pub mps: Option<MpsClient>,
    /// Who holds the device's memory and compute limits.
    pub holders: Holders,
}

impl PreparedDeviceFacts {
    /// Facts of a device that is not a MIG device and has no MPS daemon: the record's UUID is
    /// the GPU's.
    pub fn of_record(record: DeviceRecord) -> Self {
        PreparedDeviceFacts {
            gpu_uuid: record.uuid.clone(),
            holders: enforcement::holders(
                record.sharing,
                record.mig.is_some(),
                record.limits,
                None,
            ),
            record,
            mig_profile: None,
            mps: None,
        }
    }
}

/// The status entry of one prepared device: its identity (driver, pool, device, shareID),
/// `Ready=True` with `reason` `PREPARED_REASON` since `prepared_at`, and `device_data`.
pub fn allocated_device_status(
    driver: &str,
    node: &str,
    facts: &PreparedDeviceFacts,
    prepared_at: &Time,
) -> AllocatedDeviceStatus {
    let record = &facts.record;
    AllocatedDeviceStatus {
        driver: driver.to_owned(),
        pool: record.pool_name.clone(),
        device: record.device_name.clone(),
        share_id: record.share_id.clone(),
        conditions: Some(vec![Condition {
            type_: READY_CONDITION.to_owned(),
            status: "True".to_owned(),
            reason: PREPARED_REASON.to_owned(),
            message: ready_message(node, facts),
            last_transition_time: prepared_at.clone(),
            observed_generation: None,
        }]),
        data: Some(RawExtension(device_data(facts))),
        network_data: None,
    }
}

fn ready_message(node: &str, facts: &PreparedDeviceFacts) -> String {
    let record = &facts.record;
    let what = match (&facts.mig_profile, record.limits.is_whole()) {
        (Some(profile), _) => format!("MIG device {profile} of GPU {}", facts.gpu_uuid),
        (None, true) => format!("GPU {}", facts.gpu_uuid),
        (None, false) => format!("{} slice of GPU {}", record.sharing, facts.gpu_uuid),
    };
    format!("{what} prepared on node {node}; CDI devices are in the CDI spec")
}

/// kerf's result for one device as a JSON object of at most [`DATA_MAX_BYTES`]: the GPU UUID
/// (and MIG UUID and profile), the slice's memory and compute share, the sharing strategy,
/// the time slice, the MPS pipe directory (host and container path) and the CDI device IDs.
///
/// Everything but the CDI IDs and MPS paths is bounded by construction; should those make
/// the object too large (IDs and paths are not length-limited here), the IDs are replaced by
/// their count, then the MPS paths dropped, each time with `truncated: true`, so the write is
/// never refused for its size.
fn device_data(facts: &PreparedDeviceFacts) -> Value {
    let full = full_data(facts);
    if encoded_len(&full) <= DATA_MAX_BYTES {
        return full;
    }
    let mut smaller = full;
    if let Some(map) = smaller.as_object_mut() {
        map.remove("cdiDeviceIDs");
        map.insert(
            "cdiDeviceIDCount".to_owned(),
            json!(facts.record.cdi_device_ids.len()),
        );
        map.insert("truncated".to_owned(), json!(true));
    }
    if encoded_len(&smaller) <= DATA_MAX_BYTES {
        return smaller;
    }
    if let Some(map) = smaller.as_object_mut() {
        map.remove("mps");
    }
    if encoded_len(&smaller) <= DATA_MAX_BYTES {
        return smaller;
    }
    // Only UUIDs and the profile remain, and those come from the driver; keep the minimum.
    json!({"gpuUUID": truncate(&facts.gpu_uuid, 256), "truncated": true})
}

fn full_data(facts: &PreparedDeviceFacts) -> Value {
    let record = &facts.record;
    let mut data = Map::new();
    data.insert("gpuUUID".to_owned(), json!(facts.gpu_uuid));
    if let Some(profile) = &facts.mig_profile {
        data.insert("migUUID".to_owned(), json!(record.uuid));
        data.insert("migProfile".to_owned(), json!(profile));
    }
    if record.limits.is_whole() {
        data.insert("wholeDevice".to_owned(), json!(true));
    }
    if let Some(bytes) = record.limits.memory_bytes {
        data.insert("memoryBytes".to_owned(), json!(bytes));
    }
    if let Some(percent) = record.limits.compute_percent {
        data.insert("computePercent".to_owned(), json!(percent));
    }
    data.insert("sharing".to_owned(), json!(record.sharing.as_str()));
    data.insert(
        "limitsHeldBy".to_owned(),
        json!({
            "memory": facts.holders.memory.as_str(),
            "compute": facts.holders.compute.as_str(),
        }),
    );
    if record.time_slice_interval != TimeSliceInterval::Default {
        data.insert(
            "timeSliceInterval".to_owned(),
            json!(record.time_slice_interval),
        );
    }
    if let Some(mps) = &facts.mps {
        data.insert(
            "mps".to_owned(),
            json!({
                "pipeDirectory": mps.pipe_directory,
                "containerPipeDirectory": mps.container_pipe_directory,
            }),
        );
    }
    if record.admin_access {
        data.insert("adminAccess".to_owned(), json!(true));
    }
    data.insert("cdiDeviceIDs".to_owned(), json!(record.cdi_device_ids));
    Value::Object(data)
}

fn encoded_len(value: &Value) -> usize {
    serde_json::to_vec(value).map_or(usize::MAX, |bytes| bytes.len())
}

fn truncate(s: &str, max_chars: usize) -> String {
    s.chars().take(max_chars).collect()
}

/// The server-side apply configuration of a claim's `status.devices` as `driver`'s field
/// manager owns it: the claim's name and namespace and nothing else but `devices`. An empty
/// `devices` withdraws every entry the manager applied before and leaves other drivers'
/// entries, the allocation and `reservedFor` alone (all owned by other managers).
pub fn status_apply_configuration(
    namespace: &str,
    name: &str,
    devices: &[AllocatedDeviceStatus],
) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "status": {"devices": devices},
    })
}

/// Whether the claim an API server answered with carries `driver`'s entry for every device
/// in `applied`: false when the server dropped `status.devices` (its
/// `DRAResourceClaimDeviceStatus` gate is off: kubernetes/kubernetes
/// `pkg/registry/resource/resourceclaim/strategy.go`, `dropDisabledDRAResourceClaimDeviceStatusFields`).
pub fn kept_device_status(
    answer: &k8s_openapi::api::resource::v1::ResourceClaim,
    applied: &[AllocatedDeviceStatus],
) -> bool {
    let kept = answer
        .status
        .as_ref()
        .and_then(|s| s.devices.as_deref())
        .unwrap_or_default();
    applied.iter().all(|wanted| {
        kept.iter().any(|entry| {
            entry.driver == wanted.driver
                && entry.pool == wanted.pool
                && entry.device == wanted.device
                && entry.share_id == wanted.share_id
        })
    })
}

#[cfg(test)]
mod tests {
    use kerf_core::enforcement::Holder;

    use super::*;
    use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimStatus};
    use kerf_core::sharing::{Sharing, SliceLimits};

    const GPU: &str = "GPU-11111111-2222-3333-4444-555555555555";
    const MIG: &str = "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee";

    fn record(device: &str) -> DeviceRecord {
        DeviceRecord {
            request_names: vec!["gpu".to_owned()],
            pool_name: "node-1".to_owned(),
            device_name: device.to_owned(),
            cdi_device_ids: vec![format!("k8s.gpu.kerf.dev/gpu=uid-{device}")],
            uuid: GPU.to_owned(),
            ..DeviceRecord::default()
        }
    }

    fn at() -> Time {
        Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH)
    }

    #[test]
    fn a_whole_gpu_is_ready_with_its_uuid_and_cdi_id() {
        let facts = PreparedDeviceFacts::of_record(record("gpu-0"));
        let status = allocated_device_status("gpu.kerf.dev", "node-1", &facts, &at());
        assert_eq!(
            (
                status.driver.as_str(),
                status.pool.as_str(),
                status.device.as_str()
            ),
            ("gpu.kerf.dev", "node-1", "gpu-0")
        );
        assert_eq!(status.share_id, None);
        let conditions = status.conditions.unwrap();
        assert_eq!(conditions.len(), 1);
        assert_eq!(conditions[0].type_, "Ready");
        assert_eq!(conditions[0].status, "True");
        assert_eq!(conditions[0].reason, "Prepared");
        assert!(
            conditions[0].message.contains(GPU),
            "{}",
            conditions[0].message
        );
        assert_eq!(
            status.data.unwrap().0,
            json!({
                "gpuUUID": GPU,
                "wholeDevice": true,
                "sharing": "Exclusive",
                "limitsHeldBy": {"memory": "hardware", "compute": "hardware"},
                "cdiDeviceIDs": ["k8s.gpu.kerf.dev/gpu=uid-gpu-0"],
            })
        );
    }

    #[test]
    fn an_mps_slice_names_its_share_and_pipe_directory() {
        let mut slice = record("gpu-1");
        slice.limits = SliceLimits {
            memory_bytes: Some(10 << 30),
            compute_percent: Some(25),
        };
        slice.sharing = Sharing::Mps;
        let facts = PreparedDeviceFacts {
            mps: Some(MpsClient {
                pipe_directory: format!("/var/run/kerf/mps/{GPU}/pipe"),
                shm_directory: "/var/run/kerf/mps/shm".to_owned(),
                container_pipe_directory: format!("/run/kerf/mps/{GPU}"),
            }),
            holders: Holders {
                memory: Holder::Server,
                compute: Holder::ClientEnvironment,
            },
            ..PreparedDeviceFacts::of_record(slice)
        };
        let data = device_data(&facts);
        assert_eq!(
            data["limitsHeldBy"],
            json!({"memory": "server", "compute": "client environment"})
        );
        assert_eq!(data["memoryBytes"], json!(10_u64 << 30));
        assert_eq!(data["computePercent"], json!(25));
        assert_eq!(data["sharing"], json!("MPS"));
        assert_eq!(data.get("wholeDevice"), None);
        assert_eq!(
            data["mps"],
            json!({
                "pipeDirectory": format!("/var/run/kerf/mps/{GPU}/pipe"),
                "containerPipeDirectory": format!("/run/kerf/mps/{GPU}"),
            })
        );
    }

    #[test]
    fn a_time_sliced_slice_names_its_interval() {
        let mut slice = record("gpu-1");
        slice.limits.memory_bytes = Some(4 << 30);
        slice.sharing = Sharing::TimeSlicing;
        slice.time_slice_interval = TimeSliceInterval::Long;
        let data = device_data(&PreparedDeviceFacts::of_record(slice));
        assert_eq!(data["sharing"], json!("TimeSlicing"));
        assert_eq!(data["timeSliceInterval"], json!("Long"));
        assert_eq!(data.get("computePercent"), None);
    }

    #[test]
    fn a_mig_device_names_its_parent_gpu_mig_uuid_and_profile() {
        let mut mig = record("gpu-0-mig-1g10gb-0");
        mig.uuid = MIG.to_owned();
        let facts = PreparedDeviceFacts {
            gpu_uuid: GPU.to_owned(),
            mig_profile: Some("1g.10gb".to_owned()),
            ..PreparedDeviceFacts::of_record(mig)
        };
        let data = device_data(&facts);
        assert_eq!(data["gpuUUID"], json!(GPU));
        assert_eq!(data["migUUID"], json!(MIG));
        assert_eq!(data["migProfile"], json!("1g.10gb"));
        let status = allocated_device_status("gpu.kerf.dev", "node-1", &facts, &at());
        let message = &status.conditions.unwrap()[0].message;
        assert!(message.contains("MIG device 1g.10gb"), "{message}");
    }

    #[test]
    fn a_share_id_keys_the_entry() {
        let mut shared = record("gpu-2");
        shared.share_id = Some("9f0c0d7e-1111-4222-8333-444455556666".to_owned());
        let status = allocated_device_status(
            "gpu.kerf.dev",
            "node-1",
            &PreparedDeviceFacts::of_record(shared),
            &at(),
        );
        assert_eq!(
            status.share_id.as_deref(),
            Some("9f0c0d7e-1111-4222-8333-444455556666")
        );
        let encoded = serde_json::to_value(&status).unwrap();
        assert_eq!(
            encoded["shareID"],
            json!("9f0c0d7e-1111-4222-8333-444455556666")
        );
    }

    #[test]
    fn data_stays_within_the_api_servers_limit() {
        let mut many = record("gpu-3");
        many.cdi_device_ids = (0..400)
            .map(|i| format!("k8s.gpu.kerf.dev/gpu=a-rather-long-device-name-{i:04}"))
            .collect();
        assert!(
            encoded_len(&full_data(&PreparedDeviceFacts::of_record(many.clone()))) > DATA_MAX_BYTES
        );
        let data = device_data(&PreparedDeviceFacts::of_record(many));
        assert!(encoded_len(&data) <= DATA_MAX_BYTES);
        assert_eq!(data["truncated"], json!(true));
        assert_eq!(data["cdiDeviceIDCount"], json!(400));
        assert_eq!(data["gpuUUID"], json!(GPU));

        let long = "/x".repeat(3000);
        let facts = PreparedDeviceFacts {
            mps: Some(MpsClient {
                pipe_directory: long.clone(),
                shm_directory: long.clone(),
                container_pipe_directory: long,
            }),
            ..PreparedDeviceFacts::of_record(record("gpu-3"))
        };
        let data = device_data(&facts);
        assert!(encoded_len(&data) <= DATA_MAX_BYTES);
        assert_eq!(data.get("mps"), None);
        assert_eq!(data["sharing"], json!("Exclusive"));
    }

    #[test]
    fn the_apply_configuration_carries_only_the_devices() {
        let status = allocated_device_status(
            "gpu.kerf.dev",
            "node-1",
            &PreparedDeviceFacts::of_record(record("gpu-0")),
            &at(),
        );
        let config = status_apply_configuration("ns", "claim", std::slice::from_ref(&status));
        assert_eq!(
            config["metadata"],
            json!({"name": "claim", "namespace": "ns"})
        );
        assert_eq!(config["status"].as_object().unwrap().len(), 1);
        assert_eq!(config["status"]["devices"][0]["device"], json!("gpu-0"));
        assert_eq!(config.get("spec"), None);
        let withdraw = status_apply_configuration("ns", "claim", &[]);
        assert_eq!(withdraw["status"]["devices"], json!([]));
    }

    #[test]
    fn an_answer_without_the_entries_means_the_field_was_dropped() {
        let status = allocated_device_status(
            "gpu.kerf.dev",
            "node-1",
            &PreparedDeviceFacts::of_record(record("gpu-0")),
            &at(),
        );
        let applied = std::slice::from_ref(&status);
        let mut answer = ResourceClaim::default();
        assert!(!kept_device_status(&answer, applied));
        answer.status = Some(ResourceClaimStatus {
            devices: Some(vec![status.clone()]),
            ..ResourceClaimStatus::default()
        });
        assert!(kept_device_status(&answer, applied));
        assert!(kept_device_status(&ResourceClaim::default(), &[]));
    }
}
