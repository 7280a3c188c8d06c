//! Device health: the faults a GPU reports, how bad each one is, and the health of every
//! published device as the kubelet's DRA health service and the device taints show it.
//!
//! Faults are recorded per physical GPU (by UUID): NVML reports XID errors, ECC errors and a
//! lost GPU per GPU, and a fault of the GPU is a fault of each MIG device on it. A source
//! (NVML, or in mock mode a fault file) sets the faults of each GPU in a [`NodeHealth`];
//! [`NodeHealth::devices`] derives the health of each published device from them.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::inventory::Inventory;

/// XIDs that NVIDIA's drivers treat as errors of the application, not of the GPU, and skip
/// (NVIDIA k8s-dra-driver-gpu `cmd/gpu-kubelet-plugin/device_health.go`, `xidsToSkip`):
/// graphics engine exception, memory page fault, GPU stopped processing, preemptive
/// clean-up, video processor exception, context switch timeout.
const APPLICATION_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// XIDs after which the GPU must be reset or the node rebooted (NVIDIA's XID catalog):
/// double-bit ECC (48), internal micro-controller halt (62), ECC page retirement or row
/// remapping failure (64), NVLink error (74), GPU fallen off the bus (79), uncontained ECC
/// (95), GSP RPC timeout and error (119, 120), unrecovered ECC (140). Work on such a GPU
/// cannot go on, so it is the `NoExecute` class of fault.
pub const FATAL_XIDS: [u64; 9] = [48, 62, 64, 74, 79, 95, 119, 120, 140];

/// The health of one device as the kubelet's DRA health service reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum HealthStatus {
    /// No fault, or only informational ones.
    Healthy,
    /// At least one fault that makes the device unfit for new work.
    Unhealthy,
    /// The device's health cannot be observed.
    Unknown,
}

/// How bad a fault is; ordered from least to most severe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Severity {
    /// Worth reporting, not a reason to keep work off the device (throttling).
    Informational,
    /// The device's health cannot be observed.
    Unobservable,
    /// The device should get no new work.
    Unhealthy,
    /// Work on the device cannot go on; it needs a reset.
    Fatal,
}

/// One fault of a GPU, as NVML reports it or a mock fault file declares it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "camelCase", deny_unknown_fields)]
pub enum Fault {
    /// An XID error event (NVML `nvmlEventTypeXidCriticalError`). Application XIDs are
    /// filtered out by the source ([`XidPolicy`]) before they become faults.
    Xid {
        /// The XID number.
        code: u64,
    },
    /// Uncorrected (double-bit) ECC errors.
    EccUncorrected,
    /// The GPU no longer answers (NVML `GPU_IS_LOST`, XID 79 without an event).
    GpuLost,
    /// Clocks held down by temperature.
    ThermalThrottle,
    /// Clocks held down by the power cap or power brake.
    PowerThrottle,
    /// Health events cannot be registered or read for this GPU.
    Unmonitored {
        /// Why, in words.
        reason: String,
    },
}

impl Fault {
    /// How bad the fault is.
    fn severity(&self) -> Severity {
        match self {
            Fault::Xid { code } if FATAL_XIDS.contains(code) => Severity::Fatal,
            Fault::Xid { .. } => Severity::Unhealthy,
            Fault::EccUncorrected | Fault::GpuLost => Severity::Fatal,
            Fault::ThermalThrottle | Fault::PowerThrottle => Severity::Informational,
            Fault::Unmonitored { .. } => Severity::Unobservable,
        }
    }

    /// A short machine-readable name, used as the device taint's value (a label value).
    pub fn reason(&self) -> String {
        match self {
            Fault::Xid { code } => format!("xid-{code}"),
            Fault::EccUncorrected => "ecc-uncorrected".to_owned(),
            Fault::GpuLost => "gpu-lost".to_owned(),
            Fault::ThermalThrottle => "thermal-throttle".to_owned(),
            Fault::PowerThrottle => "power-throttle".to_owned(),
            Fault::Unmonitored { .. } => "unmonitored".to_owned(),
        }
    }

    /// The fault in words, for the kubelet's health message and logs.
    pub fn describe(&self) -> String {
        match self {
            Fault::Xid { code } if FATAL_XIDS.contains(code) => {
                format!("XID {code} (fatal: the GPU needs a reset)")
            }
            Fault::Xid { code } => format!("XID {code}"),
            Fault::EccUncorrected => "uncorrected ECC errors".to_owned(),
            Fault::GpuLost => "GPU lost (fallen off the bus or not answering)".to_owned(),
            Fault::ThermalThrottle => "thermal throttling".to_owned(),
            Fault::PowerThrottle => "power throttling".to_owned(),
            Fault::Unmonitored { reason } => format!("health not observable: {reason}"),
        }
    }
}

/// Which XIDs count as faults: all except `APPLICATION_XIDS` and the admin's additions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XidPolicy {
    ignored: BTreeSet<u64>,
}

impl Default for XidPolicy {
    fn default() -> Self {
        XidPolicy::ignoring(std::iter::empty())
    }
}

impl XidPolicy {
    /// Ignores `APPLICATION_XIDS` and `additional` ones.
    pub fn ignoring(additional: impl IntoIterator<Item = u64>) -> Self {
        XidPolicy {
            ignored: APPLICATION_XIDS.into_iter().chain(additional).collect(),
        }
    }

    /// The fault an XID event is, `None` for an ignored XID.
    pub fn fault(&self, code: u64) -> Option<Fault> {
        (!self.ignored.contains(&code)).then_some(Fault::Xid { code })
    }
}

/// The faults of every GPU of a node, by GPU UUID. GPUs without an entry have none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeHealth {
    faults: BTreeMap<String, BTreeSet<FaultKey>>,
}

/// A fault ordered for a stable set (by severity, then description).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct FaultKey(std::cmp::Reverse<Severity>, String, FaultOrd);

#[derive(Debug, Clone, PartialEq, Eq)]
struct FaultOrd(Fault);

impl PartialOrd for FaultOrd {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for FaultOrd {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.reason().cmp(&other.0.reason())
    }
}

impl FaultKey {
    fn new(fault: Fault) -> Self {
        FaultKey(
            std::cmp::Reverse(fault.severity()),
            fault.describe(),
            FaultOrd(fault),
        )
    }
}

impl NodeHealth {
    /// Replaces the faults of GPU `uuid` (none makes it healthy again). Returns whether
    /// anything changed.
    pub fn set_faults(&mut self, uuid: &str, faults: impl IntoIterator<Item = Fault>) -> bool {
        let faults: BTreeSet<FaultKey> = faults.into_iter().map(FaultKey::new).collect();
        let changed = self
            .faults
            .get(uuid)
            .map_or(!faults.is_empty(), |old| *old != faults);
        if faults.is_empty() {
            self.faults.remove(uuid);
        } else {
            self.faults.insert(uuid.to_owned(), faults);
        }
        changed
    }

    /// Adds one fault to GPU `uuid`. Returns whether it was new.
    pub fn add_fault(&mut self, uuid: &str, fault: Fault) -> bool {
        self.faults
            .entry(uuid.to_owned())
            .or_default()
            .insert(FaultKey::new(fault))
    }

    /// The faults of GPU `uuid`, most severe first.
    pub fn faults(&self, uuid: &str) -> impl Iterator<Item = &Fault> {
        self.faults.get(uuid).into_iter().flatten().map(|k| &k.2.0)
    }

    /// The health of every device `inventory` publishes, in inventory order: each takes the
    /// faults of its physical GPU.
    pub fn devices(&self, inventory: &Inventory) -> Vec<DeviceHealth> {
        inventory
            .devices()
            .map(|device| {
                let faults: Vec<Fault> = self.faults(&device.gpu().uuid).cloned().collect();
                DeviceHealth::of(device.name(), device.uuid().to_owned(), faults)
            })
            .collect()
    }
}

/// The health of one published device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceHealth {
    /// Published device name, e.g. `gpu-0`.
    pub device: String,
    /// UUID of the device (GPU or MIG).
    pub uuid: String,
    /// The health the kubelet is told.
    pub status: HealthStatus,
    /// The faults of its GPU, most severe first.
    pub faults: Vec<Fault>,
}

impl DeviceHealth {
    /// A device's health from its GPU's faults: unhealthy with any unhealthy or fatal fault,
    /// unknown when its health cannot be observed, healthy otherwise (throttling included).
    pub fn of(device: String, uuid: String, faults: Vec<Fault>) -> Self {
        let status = match faults.iter().map(Fault::severity).max() {
            Some(Severity::Unhealthy | Severity::Fatal) => HealthStatus::Unhealthy,
            Some(Severity::Unobservable) => HealthStatus::Unknown,
            Some(Severity::Informational) | None => HealthStatus::Healthy,
        };
        DeviceHealth {
            device,
            uuid,
            status,
            faults,
        }
    }

    /// Every fault in words, most severe first; empty when healthy.
    pub fn message(&self) -> String {
        self.faults
            .iter()
            .map(Fault::describe)
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// The effect of a device taint (`resource.k8s.io/v1` `DeviceTaint.effect`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TaintEffect {
    /// No taint at all.
    None,
    /// No new allocations of the device.
    NoSchedule,
    /// No new allocations, and pods using the device are evicted.
    NoExecute,
}

impl TaintEffect {
    /// The API's spelling, `None` for [`TaintEffect::None`] (which publishes no taint).
    pub fn api_name(self) -> Option<&'static str> {
        match self {
            TaintEffect::None => None,
            TaintEffect::NoSchedule => Some("NoSchedule"),
            TaintEffect::NoExecute => Some("NoExecute"),
        }
    }
}

impl std::str::FromStr for TaintEffect {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "None" => Ok(TaintEffect::None),
            "NoSchedule" => Ok(TaintEffect::NoSchedule),
            "NoExecute" => Ok(TaintEffect::NoExecute),
            other => Err(format!(
                "{other:?} is not a taint effect; expected None, NoSchedule or NoExecute"
            )),
        }
    }
}

/// Which taint an unhealthy device gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaintPolicy {
    /// Effect for `Severity::Unhealthy` faults.
    pub unhealthy: TaintEffect,
    /// Effect for `Severity::Fatal` faults.
    pub fatal: TaintEffect,
}

impl Default for TaintPolicy {
    fn default() -> Self {
        TaintPolicy {
            unhealthy: TaintEffect::NoSchedule,
            fatal: TaintEffect::NoExecute,
        }
    }
}

impl TaintPolicy {
    /// The taint a device with `health` gets: the effect of its most severe fault and that
    /// fault's [`Fault::reason`]; `None` for a device without unhealthy or fatal faults.
    pub fn taint_for(&self, health: &DeviceHealth) -> Option<(TaintEffect, String)> {
        let worst = health.faults.first()?;
        let effect = match worst.severity() {
            Severity::Fatal => self.fatal,
            Severity::Unhealthy => self.unhealthy,
            Severity::Informational | Severity::Unobservable => return None,
        };
        (effect != TaintEffect::None).then(|| (effect, worst.reason()))
    }
}

/// The mock fault file: published device name or GPU UUID → its GPU's faults. An empty or
/// missing file means every GPU is healthy.
///
/// ```yaml
/// gpu-0:
///   - kind: xid
///     code: 79
/// gpu-1:
///   - kind: thermalThrottle
/// ```
pub type FaultFile = BTreeMap<String, Vec<Fault>>;

/// Parses a mock fault file and resolves each key to a GPU UUID of `inventory`.
///
/// # Errors
///
/// [`crate::Error::Yaml`] when the text does not decode (unknown kinds and fields are
/// refused), [`crate::Error::InvalidInventory`] when a key names no GPU of the inventory.
pub fn parse_fault_file(
    text: &str,
    inventory: &Inventory,
) -> crate::Result<BTreeMap<String, Vec<Fault>>> {
    if text.trim().is_empty() {
        return Ok(BTreeMap::new());
    }
    let file: Option<FaultFile> =
        serde_saphyr::from_str(text).map_err(|source| crate::Error::Yaml {
            what: "mock fault file".to_owned(),
            source: Box::new(source),
        })?;
    let mut by_gpu: BTreeMap<String, Vec<Fault>> = BTreeMap::new();
    for (key, faults) in file.unwrap_or_default() {
        let gpu = inventory
            .devices()
            .find(|d| d.name() == key || d.uuid() == key || d.gpu().uuid == key)
            .map(|d| d.gpu().uuid.clone())
            .ok_or_else(|| {
                crate::Error::InvalidInventory(format!(
                    "mock fault file names {key:?}, which is no device name or UUID of this node"
                ))
            })?;
        by_gpu.entry(gpu).or_default().extend(faults);
    }
    Ok(by_gpu)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mock;

    fn inventory() -> Inventory {
        mock::from_spec("a100-40gb-mig:2").expect("mock profile")
    }

    #[test]
    fn application_xids_are_ignored_and_fatal_ones_are_fatal() {
        let policy = XidPolicy::ignoring([94]);
        assert_eq!(policy.fault(13), None);
        assert_eq!(policy.fault(94), None);
        assert_eq!(
            policy.fault(79).map(|f| f.severity()),
            Some(Severity::Fatal)
        );
        assert_eq!(
            policy.fault(61).map(|f| f.severity()),
            Some(Severity::Unhealthy)
        );
    }

    #[test]
    fn a_gpu_fault_reaches_its_mig_devices_and_throttling_stays_healthy() {
        let inventory = inventory();
        let mut health = NodeHealth::default();
        let first = inventory.gpus[0].uuid.clone();
        let second = inventory.gpus[1].uuid.clone();
        assert!(health.set_faults(&first, [Fault::Xid { code: 79 }, Fault::ThermalThrottle]));
        assert!(!health.set_faults(&first, [Fault::ThermalThrottle, Fault::Xid { code: 79 }]));
        assert!(health.set_faults(&second, [Fault::PowerThrottle]));
        let devices = health.devices(&inventory);
        assert!(!devices.is_empty());
        for device in &devices {
            let on_first = inventory
                .devices()
                .any(|d| d.name() == device.device && d.gpu().uuid == first);
            if on_first {
                assert_eq!(device.status, HealthStatus::Unhealthy, "{device:?}");
                assert_eq!(device.faults[0], Fault::Xid { code: 79 });
                assert!(
                    device.message().starts_with("XID 79 (fatal"),
                    "{}",
                    device.message()
                );
            } else {
                assert_eq!(device.status, HealthStatus::Healthy, "{device:?}");
                assert_eq!(device.message(), "power throttling");
            }
        }
        assert!(health.set_faults(&first, []));
        assert!(
            health
                .devices(&inventory)
                .iter()
                .all(|d| d.status == HealthStatus::Healthy)
        );
    }

    #[test]
    fn taints_follow_the_worst_fault() {
        let policy = TaintPolicy::default();
        let device = |faults| DeviceHealth::of("gpu-0".into(), "GPU-0".into(), faults);
        assert_eq!(policy.taint_for(&device(vec![])), None);
        assert_eq!(
            policy.taint_for(&device(vec![Fault::ThermalThrottle])),
            None
        );
        let unmonitored = Fault::Unmonitored {
            reason: "no events".into(),
        };
        assert_eq!(
            device(vec![unmonitored.clone()]).status,
            HealthStatus::Unknown
        );
        assert_eq!(policy.taint_for(&device(vec![unmonitored])), None);
        assert_eq!(
            policy.taint_for(&device(vec![Fault::Xid { code: 61 }])),
            Some((TaintEffect::NoSchedule, "xid-61".into()))
        );
        assert_eq!(
            policy.taint_for(&device(vec![Fault::GpuLost])),
            Some((TaintEffect::NoExecute, "gpu-lost".into()))
        );
        let lenient = TaintPolicy {
            fatal: TaintEffect::NoSchedule,
            unhealthy: TaintEffect::None,
        };
        assert_eq!(
            lenient.taint_for(&device(vec![Fault::GpuLost])),
            Some((TaintEffect::NoSchedule, "gpu-lost".into()))
        );
        assert_eq!(
            lenient.taint_for(&device(vec![Fault::Xid { code: 61 }])),
            None
        );
    }

    #[test]
    fn the_fault_file_names_devices_by_name_or_uuid_and_refuses_strangers() {
        let inventory = inventory();
        let uuid = inventory.gpus[1].uuid.clone();
        let mig = inventory
            .devices()
            .find(|d| d.gpu().uuid == inventory.gpus[0].uuid && d.name() != "gpu-0")
            .expect("a MIG device on the first GPU")
            .name();
        let text =
            format!("{mig}:\n  - kind: xid\n    code: 48\n{uuid}:\n  - kind: eccUncorrected\n");
        let parsed = parse_fault_file(&text, &inventory).expect("valid file");
        assert_eq!(
            parsed[&inventory.gpus[0].uuid],
            vec![Fault::Xid { code: 48 }]
        );
        assert_eq!(parsed[&uuid], vec![Fault::EccUncorrected]);
        assert!(parse_fault_file("", &inventory).expect("empty").is_empty());
        let err = parse_fault_file("gpu-99: []\n", &inventory).expect_err("stranger");
        assert!(err.to_string().contains("gpu-99"), "{err}");
        let err = parse_fault_file("gpu-0:\n  - kind: meltdown\n", &inventory).expect_err("kind");
        assert!(err.to_string().contains("meltdown"), "{err}");
    }
}
