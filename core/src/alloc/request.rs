//! What a pod asks the allocator for: its claims, their requests, and per request the device
//! count, slice size, selector, topology and policy (already merged from claim and class).

use crate::enforcement::Enforcement;
use crate::inventory::ComputeCapability;
use crate::mps::TimeSliceInterval;
use crate::sharing::Sharing;

use super::model::GpuInfo;
pub use super::model::SliceSize;
use super::taint::Toleration;

/// All the controller-allocated claims of one pod; they are placed together on one node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodRequest {
    /// The claims, in the order the placement reports them.
    pub claims: Vec<ClaimRequest>,
}

/// One ResourceClaim's requests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClaimRequest {
    /// The claim's key in the [`Index`](super::Index): its UID.
    pub key: String,
    /// The requests (`spec.devices.requests[]`), in order.
    pub requests: Vec<DeviceRequest>,
}

/// One request of a claim: `count` distinct GPUs, each whole or sliced; or, with
/// [`DeviceRequest::first_available`], the first of its subrequests that fits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceRequest {
    /// Request name, copied into the allocation results. A subrequest's name is the full
    /// `parent/sub`, as results name it.
    pub name: String,
    /// How many distinct GPUs (at least 1).
    pub count: u32,
    /// The share of each GPU; `None` asks for whole GPUs.
    pub slice: Option<SliceSize>,
    /// Which GPUs qualify.
    pub selector: GpuSelector,
    /// How close the `count` GPUs must be to each other.
    pub topology: TopologyScope,
    /// How GPUs and nodes are chosen among those that fit.
    pub policy: Policy,
    /// Most slices (from every writer) one GPU may carry, this one included.
    pub max_slices_per_gpu: Option<u32>,
    /// Sharing strategy, passed through to the placement.
    pub sharing: Sharing,
    /// The class's time slice for [`Sharing::TimeSlicing`], passed through to the placement;
    /// `None` leaves the GPU at the driver's default. It never affects where a request goes:
    /// the node settles claims that disagree on one GPU.
    pub time_slice_interval: Option<TimeSliceInterval>,
    /// The weakest holder of an MPS slice's limits the class accepts: with
    /// [`Enforcement::Server`] the slice shares its GPU only with MPS slices of its size.
    pub enforcement: Enforcement,
    /// Taints of devices this request may use anyway.
    pub tolerations: Vec<Toleration>,
    /// Admin access (`exactly.adminAccess`): `count` whole GPUs whoever uses them, consuming
    /// nothing; taints still apply, and the claim's own devices stay distinct.
    pub admin_access: bool,
    /// Subrequests (`firstAvailable`, at most [`MAX_SUBREQUESTS`]), tried in order; the pod
    /// gets the first combination of its requests' subrequests that fits some candidate
    /// node. When set, this request's own count, slice and selector are not used.
    pub first_available: Vec<DeviceRequest>,
}

/// Most subrequests of one request (`FirstAvailableDeviceRequestMaxSize`).
pub const MAX_SUBREQUESTS: usize = 8;

impl DeviceRequest {
    /// A request for `count` whole GPUs with no constraints and the default policy
    /// ([`Policy::LeastFragmentation`]).
    pub fn whole(name: impl Into<String>, count: u32) -> Self {
        DeviceRequest {
            name: name.into(),
            count,
            slice: None,
            selector: GpuSelector::default(),
            topology: TopologyScope::Any,
            policy: Policy::default(),
            max_slices_per_gpu: None,
            sharing: Sharing::Exclusive,
            time_slice_interval: None,
            enforcement: Enforcement::default(),
            tolerations: Vec::new(),
            admin_access: false,
            first_available: Vec::new(),
        }
    }

    /// A request for `count` slices of the given size, otherwise as [`DeviceRequest::whole`].
    pub fn slices(name: impl Into<String>, count: u32, size: SliceSize) -> Self {
        DeviceRequest {
            slice: Some(size),
            ..DeviceRequest::whole(name, count)
        }
    }
}

/// Which GPUs a request may use. Every set field must match; the default matches all.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct GpuSelector {
    /// Product names, any of which matches (exact comparison). Empty matches every product.
    pub product_names: Vec<String>,
    /// Minimum total memory of the GPU.
    pub min_memory_bytes: Option<u64>,
    /// Minimum CUDA compute capability.
    pub min_compute_capability: Option<ComputeCapability>,
}

impl GpuSelector {
    /// True when `gpu` satisfies every set field.
    pub fn matches(&self, gpu: &GpuInfo) -> bool {
        (self.product_names.is_empty() || self.product_names.contains(&gpu.product))
            && self
                .min_memory_bytes
                .is_none_or(|min| gpu.memory_bytes >= min)
            && self
                .min_compute_capability
                .is_none_or(|min| gpu.compute_capability >= min)
    }

    /// True when the selector matches every GPU.
    pub fn is_empty(&self) -> bool {
        self.product_names.is_empty()
            && self.min_memory_bytes.is_none()
            && self.min_compute_capability.is_none()
    }
}

/// How close the GPUs of one request must be to each other.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum TopologyScope {
    /// Any GPUs of the node; sets in one NVLink domain are preferred, then sets behind one
    /// PCIe root.
    #[default]
    Any,
    /// All GPUs behind one PCIe root complex (GPUs without a known root never qualify).
    PcieRoot,
    /// All GPUs in one NVLink domain (GPUs without a domain never qualify).
    NvLink,
}

/// How the allocator chooses among GPUs and nodes that fit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Policy {
    /// Keep the cluster's free capacity usable by the pods it runs: the node and GPUs whose
    /// use least increases the fragmentation of the node against the learned workload, its
    /// stranded GPUs included (see [`place_with`](super::place_with)). Without a workload
    /// ([`place`](super::place), or an empty one) it places as BinPack.
    #[default]
    LeastFragmentation,
    /// Fill used GPUs and nodes first: least free capacity left after placement.
    BinPack,
    /// Use idle GPUs and nodes first: most free capacity left after placement.
    Spread,
}
