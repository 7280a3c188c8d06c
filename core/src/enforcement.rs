//! Who holds a slice's limits against the process that uses it, and the limits an MPS control
//! daemon gives its server.
//!
//! An MPS slice's limits reach its container as `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` and
//! `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`, which a process may clear before it initializes CUDA.
//! NVIDIA documents that a client's variables "only further constrain" what the control daemon
//! set for its server (`set_default_active_thread_percentage`,
//! `set_default_device_pinned_mem_limit`, and `set_active_thread_percentage <PID>`,
//! `set_device_pinned_mem_limit <PID> <dev> <value>` for a running server, which affect the
//! clients created afterwards; MPS documentation, "Appendix: Tools and Interface Reference").
//! One server serves every client of a GPU (one Linux user), so its limits are every client's
//! ceiling: [`ServerLimits::for_slices`] sets them to the largest slice on the GPU, and a slice
//! of exactly that size is held by the server even against a process that clears its
//! environment; a smaller one only by its environment, up to the server's ceiling.
//!
//! A GpuClass that requires [`Enforcement::Server`] therefore shares a GPU only among MPS
//! slices of one size (the allocator keeps them so, as MIG keeps one profile per instance).

use serde::{Deserialize, Serialize};

use crate::sharing::{Sharing, SliceLimits};

/// The weakest holder of a slice's limits a class accepts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Enforcement {
    /// Any (the default): an MPS slice may share its GPU with slices of other sizes and is
    /// then held only by its container's environment, which its process can clear.
    #[default]
    ClientEnvironment,
    /// The MPS server's limits hold every slice: its GPU carries MPS slices of one size only.
    Server,
}

impl Enforcement {
    /// The name used in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            Enforcement::ClientEnvironment => "ClientEnvironment",
            Enforcement::Server => "Server",
        }
    }

    /// True for the default, which an allocation does not write.
    pub fn is_default(&self) -> bool {
        *self == Enforcement::default()
    }
}

/// What holds one limit of a prepared device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Holder {
    /// The hardware: a whole GPU or a MIG device has nothing more to take.
    Hardware,
    /// The GPU's MPS server: the control daemon's limit equals the slice's.
    Server,
    /// Only the container's environment: a process that clears it gets up to the server's
    /// ceiling (or the whole GPU when the server has none).
    ClientEnvironment,
    /// Nothing: a time-sliced slice's memory is not limited at all.
    None,
}

impl Holder {
    /// The name shown in claim status and `kerf status`.
    pub fn as_str(self) -> &'static str {
        match self {
            Holder::Hardware => "hardware",
            Holder::Server => "server",
            Holder::ClientEnvironment => "client environment",
            Holder::None => "none",
        }
    }
}

/// Who holds a device's memory and compute limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Holders {
    /// The memory limit's holder.
    pub memory: Holder,
    /// The compute limit's holder.
    pub compute: Holder,
}

/// The limits an MPS control daemon gives its GPU's server; `None` is "no limit".
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServerLimits {
    /// `set_default_device_pinned_mem_limit`, in whole MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned_mib: Option<u64>,
    /// `set_default_active_thread_percentage`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread_percentage: Option<u8>,
}

impl ServerLimits {
    /// The limits for the MPS slices of one GPU: the largest of each, so that no slice is
    /// held below its size; a slice without a limit in one dimension (or none at all) leaves
    /// that dimension unlimited.
    pub fn for_slices(slices: impl IntoIterator<Item = SliceLimits>) -> Self {
        let mut any = false;
        let mut memory = Some(0);
        let mut compute = Some(0);
        for slice in slices {
            any = true;
            memory = max_limit(memory, slice.memory_bytes.map(pinned_mib));
            compute = max_limit(compute, slice.compute_percent);
        }
        if !any {
            return ServerLimits::default();
        }
        ServerLimits {
            pinned_mib: memory,
            thread_percentage: compute.filter(|&p| p < 100),
        }
    }

    /// The control daemon's commands that make these the defaults of its next server. An
    /// unlimited dimension gets the documented default back: 100 percent, and a memory limit
    /// as large as the GPU's memory `total_mib` (memory limiting has no documented "off").
    ///
    /// The device is named `0`: kerf's daemon sees only its GPU (`CUDA_VISIBLE_DEVICES`), as
    /// its clients do, and limits keyed by UUID were found not applied by NVIDIA's device
    /// plugin (NVIDIA/k8s-device-plugin, which moved to indices for that reason).
    pub fn default_commands(&self, total_mib: u64) -> Vec<String> {
        vec![
            format!(
                "set_default_device_pinned_mem_limit 0 {}M",
                self.pinned_mib.unwrap_or(total_mib)
            ),
            format!(
                "set_default_active_thread_percentage {}",
                self.thread_percentage.unwrap_or(100)
            ),
        ]
    }

    /// The commands that give a running server `pid` these limits for its next clients.
    pub fn server_commands(&self, pid: u32, total_mib: u64) -> Vec<String> {
        vec![
            format!(
                "set_device_pinned_mem_limit {pid} 0 {}M",
                self.pinned_mib.unwrap_or(total_mib)
            ),
            format!(
                "set_active_thread_percentage {pid} {}",
                self.thread_percentage.unwrap_or(100)
            ),
        ]
    }
}

/// The larger of two limits, `None` (unlimited) winning.
fn max_limit<T: Ord>(a: Option<T>, b: Option<T>) -> Option<T> {
    Some(a?.max(b?))
}

/// A memory limit in the whole MiB the MPS limits take, rounded down so that it never
/// exceeds the slice (and at least 1): the same figure the client's environment gets.
pub fn pinned_mib(bytes: u64) -> u64 {
    (bytes >> 20).max(1)
}

/// Who holds the limits of a device shared by `sharing` with `limits`, on a whole GPU or a
/// MIG device (`mig`). `server` is the limits of the MPS server of an MPS device's GPU, `None`
/// when no kerf daemon serves it (GPU tools off): CUDA then ignores the MPS variables and the
/// slice is accounting only, as is an exclusively shared slice.
pub fn holders(
    sharing: Sharing,
    mig: bool,
    limits: SliceLimits,
    server: Option<ServerLimits>,
) -> Holders {
    let all = |holder| Holders {
        memory: holder,
        compute: holder,
    };
    if mig || limits.is_whole() {
        return all(Holder::Hardware);
    }
    match (sharing, server) {
        (Sharing::TimeSlicing, _) => Holders {
            memory: Holder::None,
            compute: Holder::Hardware,
        },
        (Sharing::Mps, Some(server)) => Holders {
            memory: held(limits.memory_bytes.map(pinned_mib), server.pinned_mib),
            compute: held(limits.compute_percent, server.thread_percentage),
        },
        (Sharing::Mps | Sharing::Exclusive, _) => all(Holder::None),
    }
}

/// One MPS limit's holder: the hardware when the slice has the whole of it, the server when
/// its limit is the slice's.
fn held<T: PartialEq>(slice: Option<T>, server: Option<T>) -> Holder {
    match (slice, server) {
        (None, _) => Holder::Hardware,
        (Some(s), Some(v)) if s == v => Holder::Server,
        (Some(_), _) => Holder::ClientEnvironment,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn slice(gib: u64, percent: u8) -> SliceLimits {
        SliceLimits {
            memory_bytes: Some(gib * GIB),
            compute_percent: Some(percent),
        }
    }

    #[test]
    fn the_server_gets_the_largest_slice_and_holds_only_that_size() {
        let server = ServerLimits::for_slices([slice(10, 25), slice(20, 50)]);
        assert_eq!(server.pinned_mib, Some(20 * 1024));
        assert_eq!(server.thread_percentage, Some(50));
        let big = holders(Sharing::Mps, false, slice(20, 50), Some(server));
        assert_eq!((big.memory, big.compute), (Holder::Server, Holder::Server));
        let small = holders(Sharing::Mps, false, slice(10, 25), Some(server));
        assert_eq!(small.memory, Holder::ClientEnvironment);
        assert_eq!(small.compute, Holder::ClientEnvironment);
    }

    #[test]
    fn slices_of_one_size_are_all_held_by_the_server() {
        let server = ServerLimits::for_slices([slice(10, 25); 3]);
        let one = holders(Sharing::Mps, false, slice(10, 25), Some(server));
        assert_eq!((one.memory, one.compute), (Holder::Server, Holder::Server));
    }

    #[test]
    fn an_unlimited_dimension_stays_unlimited() {
        let memory_only = SliceLimits {
            memory_bytes: Some(8 * GIB),
            compute_percent: None,
        };
        let server = ServerLimits::for_slices([memory_only, slice(4, 30)]);
        assert_eq!(server.pinned_mib, Some(8 * 1024));
        assert_eq!(server.thread_percentage, None);
        assert_eq!(
            ServerLimits::for_slices([slice(4, 100)]).thread_percentage,
            None
        );
        assert_eq!(ServerLimits::for_slices([]), ServerLimits::default());
        assert_eq!(
            ServerLimits::default().default_commands(81_559),
            [
                "set_default_device_pinned_mem_limit 0 81559M",
                "set_default_active_thread_percentage 100"
            ]
        );
        assert_eq!(
            ServerLimits::for_slices([slice(10, 25)]).server_commands(42, 81_559),
            [
                "set_device_pinned_mem_limit 42 0 10240M",
                "set_active_thread_percentage 42 25"
            ]
        );
    }

    #[test]
    fn time_slicing_leaves_memory_unheld_and_hardware_holds_the_rest() {
        let t = holders(Sharing::TimeSlicing, false, slice(10, 25), None);
        assert_eq!((t.memory, t.compute), (Holder::None, Holder::Hardware));
        let mig = holders(Sharing::Mps, true, slice(10, 25), None);
        assert_eq!(mig.memory, Holder::Hardware);
        let whole = holders(Sharing::Mps, false, SliceLimits::default(), None);
        assert_eq!(whole.compute, Holder::Hardware);
        let no_daemon = holders(Sharing::Mps, false, slice(10, 25), None);
        assert_eq!(no_daemon.memory, Holder::None);
        let accounting = holders(Sharing::Exclusive, false, slice(10, 25), None);
        assert_eq!(accounting.compute, Holder::None);
        assert_eq!(Holder::ClientEnvironment.as_str(), "client environment");
    }
}
