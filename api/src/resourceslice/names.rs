//! The names kerf's ResourceSlices use and the API server's rules for names and sizes: the
//! attribute and capacity names, the device types, the limits of a slice and a device, and
//! the checks and conversions of names and versions. The lowest module of
//! [`super`](crate::resourceslice): every part of building a slice reads it, it reads none.

/// Most devices one ResourceSlice may hold (without taints, counters or list attributes).
pub(crate) const MAX_DEVICES_PER_SLICE: usize = 128;
/// Most attributes and capacities one device may have, combined.
pub(crate) const MAX_ATTRIBUTES_AND_CAPACITIES: usize = 32;
/// Longest string or version attribute value, in bytes.
pub(crate) const MAX_ATTRIBUTE_VALUE_LEN: usize = 64;
/// Longest identifier part of an attribute or capacity name.
pub(crate) const MAX_QUALIFIED_NAME_ID_LEN: usize = 32;
/// Longest domain part of an attribute or capacity name, and longest driver name.
pub(crate) const MAX_DOMAIN_LEN: usize = 63;
/// Longest device name (a DNS label).
pub(crate) const MAX_DEVICE_NAME_LEN: usize = 63;
/// Longest object name (a DNS subdomain), and longest pool name.
pub(crate) const MAX_NAME_LEN: usize = 253;

/// Names of the attributes kerf publishes.
pub mod attributes {
    /// `gpu` for a whole GPU, `mig` for a MIG device (string).
    pub const TYPE: &str = "type";
    /// NVML UUID of the device: `GPU-…` or `MIG-…` (string).
    pub const UUID: &str = "uuid";
    /// Product name, e.g. `NVIDIA H100 80GB HBM3` (string).
    pub const PRODUCT_NAME: &str = "productName";
    /// Brand, e.g. `Nvidia` (string).
    pub const BRAND: &str = "brand";
    /// Architecture, e.g. `Hopper` (string).
    pub const ARCHITECTURE: &str = "architecture";
    /// CUDA compute capability as semver, e.g. `9.0.0` (version).
    pub const CUDA_COMPUTE_CAPABILITY: &str = "cudaComputeCapability";
    /// Kernel driver version as semver, e.g. `570.124.6` for `570.124.06` (version).
    pub const DRIVER_VERSION: &str = "driverVersion";
    /// CUDA driver API version as semver, e.g. `12.8.0` (version), when known.
    pub(crate) const CUDA_DRIVER_VERSION: &str = "cudaDriverVersion";
    /// NVML index of a whole GPU (int).
    pub const INDEX: &str = "index";
    /// Minor number of a whole GPU (int).
    pub const MINOR: &str = "minor";
    /// NVLink domain of the GPU, when it has one (string).
    pub const NVLINK_DOMAIN: &str = "nvlinkDomain";
    /// NUMA node of the GPU, when known (int).
    pub(crate) const NUMA_NODE: &str = "numaNode";
    /// MIG profile, e.g. `1g.10gb` (string).
    pub const PROFILE: &str = "profile";
    /// UUID of a MIG device's parent GPU (string).
    pub const PARENT_UUID: &str = "parentUUID";
    /// Minor number of a MIG device's parent GPU (int).
    pub const PARENT_MINOR: &str = "parentMinor";
    /// First memory slice of a MIG device's placement (int).
    pub const PLACEMENT_START: &str = "placementStart";
    /// Number of memory slices of a MIG device's placement (int).
    pub const PLACEMENT_SIZE: &str = "placementSize";
    /// GPU-instance profile id of a dynamic-MIG placement, what creating its GPU instance
    /// takes (int; `nvidia-smi mig -lgip`'s `ID`, e.g. 19 for `1g.5gb`).
    pub const GI_PROFILE_ID: &str = "giProfileId";
    /// Standard attribute: the PCIe root complex, `pci<domain>:<bus>` (string), when known.
    pub(crate) const PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";
    /// Standard attribute: PCI address in extended BDF notation, `0000:1b:00.0` (string).
    /// Whole GPUs only: it identifies a PCI device, which a MIG device is not.
    pub const PCI_BUS_ID: &str = "resource.kubernetes.io/pciBusID";
    /// Who may allocate the device, `scheduler` or `controller` (string); absent while the
    /// Node's ownership record does not name the device. Not set by
    /// [`resource_slices`](crate::resourceslice::resource_slices): the kubelet plugin sets it from the Node
    /// annotation `gpu.kerf.dev/allocators` that kerf-controller writes
    /// ([`crate::ownership`]).
    pub const ALLOCATOR: &str = "allocator";

    /// Every attribute name kerf may publish.
    pub const ALL: [&str; 21] = [
        TYPE,
        UUID,
        PRODUCT_NAME,
        BRAND,
        ARCHITECTURE,
        CUDA_COMPUTE_CAPABILITY,
        DRIVER_VERSION,
        CUDA_DRIVER_VERSION,
        INDEX,
        MINOR,
        NVLINK_DOMAIN,
        NUMA_NODE,
        PROFILE,
        PARENT_UUID,
        PARENT_MINOR,
        PLACEMENT_START,
        PLACEMENT_SIZE,
        GI_PROFILE_ID,
        PCIE_ROOT,
        PCI_BUS_ID,
        ALLOCATOR,
    ];
}

/// Attributes the kubelet plugin adds to each device after [`super::resource_slices`] built it:
/// [`attributes::ALLOCATOR`]. The count check reserves room for them, so setting the owner
/// can never push a device over [`MAX_ATTRIBUTES_AND_CAPACITIES`].
pub(super) const ATTRIBUTES_ADDED_LATER: usize = 1;

/// Names of the capacities kerf publishes.
pub mod capacities {
    /// Device memory in bytes.
    pub const MEMORY: &str = "memory";
    /// Streaming multiprocessors.
    pub const MULTIPROCESSORS: &str = "multiprocessors";

    /// Every capacity name kerf publishes.
    pub const ALL: [&str; 2] = [MEMORY, MULTIPROCESSORS];
}

/// `type` attribute value of a whole GPU.
pub const TYPE_GPU: &str = "gpu";
/// `type` attribute value of a MIG device.
pub const TYPE_MIG: &str = "mig";

/// Writes `major[.minor[.patch]]` as semver `major.minor.patch` without leading zeros
/// (`570.124.06` → `570.124.6`, `12.8` → `12.8.0`); `None` when it is not such a version.
pub fn semver(version: &str) -> Option<String> {
    let parts: Vec<u64> = version
        .split('.')
        .map(|part| {
            if part.bytes().all(|b| b.is_ascii_digit()) {
                part.parse().ok()
            } else {
                None
            }
        })
        .collect::<Option<_>>()?;
    match parts.as_slice() {
        [major] => Some(format!("{major}.0.0")),
        [major, minor] => Some(format!("{major}.{minor}.0")),
        [major, minor, patch] => Some(format!("{major}.{minor}.{patch}")),
        _ => None,
    }
}

/// Writes a PCI address in the standard attribute's form, lower-case `dddd:bb:dd.f`
/// (NVML's `00000000:1B:00.0` → `0000:1b:00.0`); `None` when that is not possible.
pub fn pci_bus_id(address: &str) -> Option<String> {
    let lower = address.to_ascii_lowercase();
    let (domain, rest) = lower.split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (device, function) = rest.split_once('.')?;
    let hex = |s: &str, len: usize| s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit());
    if domain.is_empty() || domain.len() > 8 || !domain.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let domain = u32::from_str_radix(domain, 16)
        .ok()
        .filter(|d| *d <= 0xffff)?;
    if !(hex(bus, 2) && hex(device, 2) && hex(function, 1)) {
        return None;
    }
    Some(format!("{domain:04x}:{bus}:{device}.{function}"))
}

/// True for a DNS-1123 subdomain: at most 253 characters, dot-separated labels of lower-case
/// letters, digits and `-` that start and end with a letter or digit.
pub fn is_dns_subdomain(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_NAME_LEN && name.split('.').all(is_label_body)
}

/// True for a DNS-1123 label: at most 63 characters of lower-case letters, digits and `-`,
/// starting and ending with a letter or digit.
pub fn is_dns_label(name: &str) -> bool {
    name.len() <= MAX_DEVICE_NAME_LEN && is_label_body(name)
}

fn is_label_body(label: &str) -> bool {
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    let bytes = label.as_bytes();
    match (bytes.first(), bytes.last()) {
        (Some(&first), Some(&last)) => {
            alnum(first) && alnum(last) && bytes.iter().all(|&b| alnum(b) || b == b'-')
        }
        _ => false,
    }
}

/// True for an attribute or capacity name the API accepts: a C identifier of at most 32
/// characters, optionally prefixed by `<DNS subdomain of at most 63 characters>/`.
pub(crate) fn is_qualified_name(name: &str) -> bool {
    let (domain, id) = match name.rsplit_once('/') {
        Some((domain, id)) => (Some(domain), id),
        None => (None, name),
    };
    let c_identifier = id.len() <= MAX_QUALIFIED_NAME_ID_LEN
        && id
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    c_identifier && domain.is_none_or(|d| d.len() <= MAX_DOMAIN_LEN && is_dns_subdomain(d))
}
