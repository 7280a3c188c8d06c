//! Raw NVML calls for the facts nvml-wrapper 0.13 has no safe API for. This is the only module
//! of kerf allowed to use `unsafe`: the crate denies `unsafe_code`, and `discovery.rs`
//! allows it for this module alone.
//!
//! - [`mig_ids`]: `nvmlDeviceGetGpuInstanceId` and `nvmlDeviceGetComputeInstanceId` on a MIG
//!   device handle;
//! - [`gpu_instance_placement`]: `nvmlDeviceGetGpuInstanceById` on the parent GPU, then
//!   `nvmlGpuInstanceGetInfo` for the instance's placement among the memory slices;
//! - [`gpu_fabric_info`]: `nvmlDeviceGetGpuFabricInfoV` (struct version 2), or the older
//!   `nvmlDeviceGetGpuFabricInfo` when the driver predates the versioned call;
//! - [`mig`]: creating, destroying and listing GPU and compute instances (dynamic MIG), with
//!   the additional soundness points its docs give, and `profiles`: the GPU-instance
//!   profiles and their placements.
//!
//! The functions only copy NVML's answers into plain values; what they mean is decided in
//! [`super::facts`]. Each returns `Ok(None)` when the loaded driver does not have the call (the
//! symbol is missing from `libnvidia-ml.so`, or NVML answers `NVML_ERROR_FUNCTION_NOT_FOUND`),
//! with a debug log, and [`Error::Nvml`] naming the call when NVML answers any other error.
//! They never panic: nvml-wrapper-sys's `NvmlLib` methods `expect` the symbol, so the function
//! table's public `Result` fields are read directly instead.
//!
//! # Why the unsafe blocks are sound
//!
//! Every unsafe block rests on the points below, and its `// SAFETY:` comment says which.
//!
//! 1. **Handles.** A device handle is taken from an nvml-wrapper [`Device`] borrowed for the
//!    whole call. A `Device<'nvml>` borrows the [`nvml_wrapper::Nvml`] that produced it, so
//!    NVML is loaded and initialised and the handle stays valid until the call returns (NVML
//!    handles live until `nvmlShutdown`, which nvml-wrapper calls only when the `Nvml` is
//!    dropped). The function pointers are read from `device.nvml().lib()`, the very table
//!    that produced the handle; they point into the `libloading::Library` that `Nvml` owns,
//!    so they too outlive the call. A GPU instance handle is one NVML itself returned with
//!    `NVML_SUCCESS`; it is checked to be non-null, used at once and never stored. NVML
//!    documents it valid until the GPU instance is destroyed and has no call to release it.
//! 2. **Out-pointers.** Each points at a local that Rust has already initialised to a valid
//!    value of the exact type the C signature names (a `c_uint`, a null handle, a struct of
//!    zeros built field by field). The structs are nvml-wrapper-sys's `#[repr(C)]` bindgen
//!    types; their sizes and the offsets read here are checked against `nvml.h` at compile
//!    time below. For the versioned fabric call the `version` field tells NVML which layout
//!    to write: version 2 (36 bytes) into a version-3 buffer (40 bytes), so NVML writes less
//!    than the buffer holds.
//! 3. **Return codes.** Every call's return code is checked, and an out-value is read only
//!    after `NVML_SUCCESS`. Before that it still holds the value Rust put there, so even a
//!    driver that returned without writing leaves nothing uninitialised behind.
//! 4. **Strings.** None of these calls takes or returns a C string, so there is no buffer
//!    whose NUL terminator must be trusted; the fabric cluster UUID is a fixed 16-byte array
//!    copied by value.
//!
//! No pointer handed to NVML outlives the call that receives it, and nothing here is shared
//! between threads (NVML is thread-safe in any case).

#![deny(
    clippy::undocumented_unsafe_blocks,
    clippy::multiple_unsafe_ops_per_block
)]

use std::fmt::Display;
use std::mem::{offset_of, size_of};
use std::os::raw::c_uint;
use std::ptr;

use kerf_core::inventory::MigPlacement;
use nvml_wrapper::Device;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper_sys::bindings::{
    nvmlGpuFabricInfo_t, nvmlGpuFabricInfo_v2_t, nvmlGpuFabricInfoV_t, nvmlGpuInstance_t,
    nvmlGpuInstanceInfo_t, nvmlGpuInstancePlacement_t,
    nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
    nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND, nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED,
    nvmlReturn_enum_NVML_SUCCESS, nvmlReturn_t,
};

use super::facts::RawFabric;
use crate::{Error, Result};

pub(crate) mod mig;
mod profiles;

pub(crate) use profiles::gi_profiles;

/// `nvmlGpuFabricInfo_v2` from `nvml.h`: `NVML_STRUCT_VERSION(GpuFabricInfo, 2)`, i.e.
/// `sizeof(nvmlGpuFabricInfo_v2_t) | 2 << 24`. Version 2 is the oldest layout the versioned
/// call accepts and carries everything kerf reads.
const FABRIC_INFO_V2: c_uint = (2 << 24) | 0x24;

// The layouts NVML writes, as `nvml.h` defines them. nvml-wrapper-sys generated its bindings
// from that header; these checks turn a future mismatch into a build error instead of memory
// corruption.
const _: () = {
    assert!(size_of::<nvmlGpuFabricInfo_t>() == 28);
    assert!(offset_of!(nvmlGpuFabricInfo_t, status) == 16);
    assert!(offset_of!(nvmlGpuFabricInfo_t, cliqueId) == 20);
    assert!(offset_of!(nvmlGpuFabricInfo_t, state) == 24);
    assert!(size_of::<nvmlGpuFabricInfo_v2_t>() == 0x24);
    assert!(size_of::<nvmlGpuFabricInfoV_t>() >= size_of::<nvmlGpuFabricInfo_v2_t>());
    assert!(offset_of!(nvmlGpuFabricInfoV_t, clusterUuid) == 4);
    assert!(offset_of!(nvmlGpuFabricInfoV_t, status) == 20);
    assert!(offset_of!(nvmlGpuFabricInfoV_t, cliqueId) == 24);
    assert!(offset_of!(nvmlGpuFabricInfoV_t, state) == 28);
    assert!(size_of::<nvmlGpuInstanceInfo_t>() == size_of::<*mut ()>() + 16);
};

/// The GPU instance and compute instance a MIG device is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MigIds {
    /// GPU instance id, unique on the parent GPU.
    pub gi_id: u32,
    /// Compute instance id, unique within the GPU instance.
    pub ci_id: u32,
}

/// The GPU instance and compute instance ids of the MIG device `mig`.
///
/// # Errors
/// [`Error::Nvml`] when NVML answers either call with an error (e.g. `mig` is not a MIG
/// device handle).
pub(crate) fn mig_ids(mig: &Device<'_>) -> Result<Option<MigIds>> {
    let lib = mig.nvml().lib();
    let (Some(get_gi_id), Some(get_ci_id)) = (
        symbol(
            "nvmlDeviceGetGpuInstanceId",
            &lib.nvmlDeviceGetGpuInstanceId,
        ),
        symbol(
            "nvmlDeviceGetComputeInstanceId",
            &lib.nvmlDeviceGetComputeInstanceId,
        ),
    ) else {
        return Ok(None);
    };
    // SAFETY: reading the handle out of a borrowed `Device` (point 1); nvml-wrapper marks it
    // unsafe only so the raw handle is not used carelessly.
    let handle = unsafe { mig.handle() };

    let mut gi_id: c_uint = 0;
    // SAFETY: a valid MIG device handle and a function of the same library (point 1); the
    // out-pointer is an initialised `c_uint` (point 2), read only after success (point 3).
    let code = unsafe { get_gi_id(handle, &raw mut gi_id) };
    if !succeeded("nvmlDeviceGetGpuInstanceId", code)? {
        return Ok(None);
    }
    let mut ci_id: c_uint = 0;
    // SAFETY: as for `nvmlDeviceGetGpuInstanceId` just above (points 1–3).
    let code = unsafe { get_ci_id(handle, &raw mut ci_id) };
    if !succeeded("nvmlDeviceGetComputeInstanceId", code)? {
        return Ok(None);
    }
    Ok(Some(MigIds { gi_id, ci_id }))
}

/// Where GPU instance `gi_id` of the MIG-enabled GPU `parent` sits among its memory slices.
/// NVML documents `nvmlDeviceGetGpuInstanceById` as needing a privileged user; without the
/// privilege this is an [`Error::Nvml`] saying so.
///
/// # Errors
/// [`Error::Nvml`] when NVML answers either call with an error, returns a null instance, or
/// describes a different instance or an empty placement.
pub(crate) fn gpu_instance_placement(
    parent: &Device<'_>,
    gi_id: u32,
) -> Result<Option<MigPlacement>> {
    let lib = parent.nvml().lib();
    let (Some(get_instance), Some(get_info)) = (
        symbol(
            "nvmlDeviceGetGpuInstanceById",
            &lib.nvmlDeviceGetGpuInstanceById,
        ),
        symbol("nvmlGpuInstanceGetInfo", &lib.nvmlGpuInstanceGetInfo),
    ) else {
        return Ok(None);
    };
    // SAFETY: reading the handle out of a borrowed `Device` (point 1).
    let handle = unsafe { parent.handle() };

    let mut instance: nvmlGpuInstance_t = ptr::null_mut();
    // SAFETY: a valid device handle and a function of the same library (point 1); the
    // out-pointer is an initialised (null) handle (point 2), used only after success and a
    // null check (point 3).
    let code = unsafe { get_instance(handle, gi_id, &raw mut instance) };
    if !succeeded("nvmlDeviceGetGpuInstanceById", code)? {
        return Ok(None);
    }
    if instance.is_null() {
        return Err(Error::Nvml(format!(
            "nvmlDeviceGetGpuInstanceById(gi {gi_id}): success with a null GPU instance"
        )));
    }
    let mut info = empty_gpu_instance_info();
    // SAFETY: `instance` is the non-null handle NVML just returned for a live GPU instance of
    // a device kept alive by the borrow (point 1); the out-pointer is a fully initialised
    // `nvmlGpuInstanceInfo_t` (point 2), read only after success (point 3).
    let code = unsafe { get_info(instance, &raw mut info) };
    if !succeeded("nvmlGpuInstanceGetInfo", code)? {
        return Ok(None);
    }
    placement_from_info(gi_id, &info).map(Some)
}

/// What the GPU `gpu` reports about its NVLink fabric registration. `Ok(None)` also when the
/// GPU has no fabric to register with (`NVML_ERROR_NOT_SUPPORTED`, the answer of every GPU
/// without NVSwitch-based NVLink).
///
/// # Errors
/// [`Error::Nvml`] when NVML answers the call with any other error.
pub(crate) fn gpu_fabric_info(gpu: &Device<'_>) -> Result<Option<RawFabric>> {
    const CALL_V: &str = "nvmlDeviceGetGpuFabricInfoV";
    const CALL_V1: &str = "nvmlDeviceGetGpuFabricInfo";
    let lib = gpu.nvml().lib();
    // SAFETY: reading the handle out of a borrowed `Device` (point 1).
    let handle = unsafe { gpu.handle() };

    if let Some(get_info_v) = symbol(CALL_V, &lib.nvmlDeviceGetGpuFabricInfoV) {
        let mut info = empty_fabric_info_v();
        // SAFETY: a valid device handle and a function of the same library (point 1); the
        // out-pointer is a fully initialised version-3-sized struct whose `version` asks for
        // the smaller version 2 (point 2), read only after success (point 3).
        let code = unsafe { get_info_v(handle, &raw mut info) };
        match classify(code) {
            Outcome::Success => return Ok(Some(fabric_from_v(&info))),
            Outcome::NotSupported => return Ok(None),
            Outcome::NotImplemented | Outcome::VersionMismatch => {
                tracing::debug!(
                    call = CALL_V,
                    code,
                    "NVML does not take this call here; trying {CALL_V1}"
                );
            }
            Outcome::Failed => return Err(failed(CALL_V, code)),
        }
    }
    let Some(get_info) = symbol(CALL_V1, &lib.nvmlDeviceGetGpuFabricInfo) else {
        return Ok(None);
    };
    let mut info = empty_fabric_info();
    // SAFETY: a valid device handle and a function of the same library (point 1); the
    // out-pointer is a fully initialised `nvmlGpuFabricInfo_t` (point 2), read only after
    // success (point 3).
    let code = unsafe { get_info(handle, &raw mut info) };
    match classify(code) {
        Outcome::Success => Ok(Some(fabric_from_v1(&info))),
        Outcome::NotSupported => Ok(None),
        Outcome::NotImplemented | Outcome::VersionMismatch => {
            tracing::debug!(call = CALL_V1, code, "NVML does not take this call here");
            Ok(None)
        }
        Outcome::Failed => Err(failed(CALL_V1, code)),
    }
}

/// The entry point `name` of the loaded library, or `None` with a debug log when the driver is
/// too old to have it. Reads the function table's field rather than calling `NvmlLib`'s
/// method of the same name, which panics on a missing symbol.
fn symbol<F: Copy, E: Display>(name: &'static str, entry: &std::result::Result<F, E>) -> Option<F> {
    match entry {
        Ok(function) => Some(*function),
        Err(error) => {
            tracing::debug!(
                call = name,
                %error,
                "the loaded NVML library does not have this function; the fact stays unknown"
            );
            None
        }
    }
}

/// How kerf treats an NVML return code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// `NVML_SUCCESS`: the out-values are written.
    Success,
    /// `NVML_ERROR_NOT_SUPPORTED`: the device does not have the feature.
    NotSupported,
    /// `NVML_ERROR_FUNCTION_NOT_FOUND`: the library exports the symbol but this driver does
    /// not implement it.
    NotImplemented,
    /// `NVML_ERROR_ARGUMENT_VERSION_MISMATCH`: the driver does not know the struct version.
    VersionMismatch,
    /// Any other error.
    Failed,
}

fn classify(code: nvmlReturn_t) -> Outcome {
    // Upper-case names, so that the match arms are patterns on constants to the linter too.
    const SUCCESS: nvmlReturn_t = nvmlReturn_enum_NVML_SUCCESS;
    const NOT_SUPPORTED: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
    const FUNCTION_NOT_FOUND: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND;
    const VERSION_MISMATCH: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    match code {
        SUCCESS => Outcome::Success,
        NOT_SUPPORTED => Outcome::NotSupported,
        FUNCTION_NOT_FOUND => Outcome::NotImplemented,
        VERSION_MISMATCH => Outcome::VersionMismatch,
        _ => Outcome::Failed,
    }
}

/// `true` on success, `false` (with a debug log) when the driver does not implement `call`,
/// and an error for every other answer.
fn succeeded(call: &'static str, code: nvmlReturn_t) -> Result<bool> {
    match classify(code) {
        Outcome::Success => Ok(true),
        Outcome::NotImplemented => {
            tracing::debug!(
                call,
                "NVML does not implement this call; the fact stays unknown"
            );
            Ok(false)
        }
        Outcome::NotSupported | Outcome::VersionMismatch | Outcome::Failed => {
            Err(failed(call, code))
        }
    }
}

fn failed(call: &'static str, code: nvmlReturn_t) -> Error {
    Error::Nvml(format!(
        "{call}: {} (NVML return code {code})",
        NvmlError::from(code)
    ))
}

fn empty_gpu_instance_info() -> nvmlGpuInstanceInfo_t {
    nvmlGpuInstanceInfo_t {
        device: ptr::null_mut(),
        id: 0,
        profileId: 0,
        placement: nvmlGpuInstancePlacement_t { start: 0, size: 0 },
    }
}

fn empty_fabric_info() -> nvmlGpuFabricInfo_t {
    nvmlGpuFabricInfo_t {
        clusterUuid: [0; 16],
        status: 0,
        cliqueId: 0,
        state: 0,
    }
}

fn empty_fabric_info_v() -> nvmlGpuFabricInfoV_t {
    nvmlGpuFabricInfoV_t {
        version: FABRIC_INFO_V2,
        clusterUuid: [0; 16],
        status: 0,
        cliqueId: 0,
        state: 0,
        healthMask: 0,
        healthSummary: 0,
    }
}

/// The placement NVML reported for GPU instance `requested`, after checking that the answer
/// is about that instance and covers at least one slice.
fn placement_from_info(requested: u32, info: &nvmlGpuInstanceInfo_t) -> Result<MigPlacement> {
    if info.id != requested {
        return Err(Error::Nvml(format!(
            "nvmlGpuInstanceGetInfo: asked about GPU instance {requested}, got instance {}",
            info.id
        )));
    }
    if info.placement.size == 0 {
        return Err(Error::Nvml(format!(
            "nvmlGpuInstanceGetInfo: GPU instance {requested} has an empty placement \
             (start {})",
            info.placement.start
        )));
    }
    Ok(MigPlacement {
        start: info.placement.start,
        size: info.placement.size,
    })
}

fn fabric_from_v1(info: &nvmlGpuFabricInfo_t) -> RawFabric {
    RawFabric {
        cluster_uuid: info.clusterUuid,
        clique_id: info.cliqueId,
        state: info.state,
        status: info.status,
    }
}

fn fabric_from_v(info: &nvmlGpuFabricInfoV_t) -> RawFabric {
    RawFabric {
        cluster_uuid: info.clusterUuid,
        clique_id: info.cliqueId,
        state: info.state,
        status: info.status,
    }
}

#[cfg(test)]
mod tests {
    use nvml_wrapper_sys::bindings::{
        NVML_GPU_FABRIC_STATE_COMPLETED, NVML_GPU_FABRIC_STATE_IN_PROGRESS,
        nvmlReturn_enum_NVML_ERROR_NO_PERMISSION,
    };

    use super::*;
    use crate::discovery::facts::{FABRIC_STATE_COMPLETED, NVML_SUCCESS, nvlink_domain};

    const CLUSTER: [u8; 16] = [
        0x6f, 0x1c, 0x2a, 0x8e, 0x4b, 0x7d, 0x4e, 0x19, 0x9a, 0x3c, 0x52, 0xd0, 0xe8, 0xf1, 0xb7,
        0x64,
    ];

    #[test]
    fn constants_match_the_bindings() {
        let v2_size = u32::try_from(size_of::<nvmlGpuFabricInfo_v2_t>()).unwrap();
        assert_eq!(FABRIC_INFO_V2, v2_size | (2 << 24));
        assert_eq!(FABRIC_INFO_V2, 0x0200_0024);
        assert_eq!(
            u32::from(FABRIC_STATE_COMPLETED),
            NVML_GPU_FABRIC_STATE_COMPLETED
        );
        assert_eq!(NVML_SUCCESS, nvmlReturn_enum_NVML_SUCCESS);
    }

    #[test]
    fn return_codes() {
        assert_eq!(classify(0), Outcome::Success);
        assert_eq!(classify(3), Outcome::NotSupported);
        assert_eq!(classify(13), Outcome::NotImplemented);
        assert_eq!(classify(25), Outcome::VersionMismatch);
        assert_eq!(classify(4), Outcome::Failed);
        assert_eq!(classify(999), Outcome::Failed);
        assert!(matches!(succeeded("f", 0), Ok(true)));
        assert!(matches!(succeeded("f", 13), Ok(false)));
        let Err(Error::Nvml(message)) = succeeded(
            "nvmlDeviceGetGpuInstanceById",
            nvmlReturn_enum_NVML_ERROR_NO_PERMISSION,
        ) else {
            panic!("NO_PERMISSION must be an error");
        };
        assert!(
            message.starts_with("nvmlDeviceGetGpuInstanceById: "),
            "{message}"
        );
        assert!(message.contains("code 4"), "{message}");
        // A device without the feature is an error where the feature is required.
        assert!(succeeded("f", 3).is_err());
    }

    #[test]
    fn missing_symbols_are_none() {
        let missing: std::result::Result<fn(), String> = Err("undefined symbol".into());
        assert!(symbol("nvmlDeviceGetGpuFabricInfoV", &missing).is_none());
        let present: std::result::Result<u8, String> = Ok(7);
        assert_eq!(symbol("f", &present), Some(7));
    }

    #[test]
    fn the_versioned_fabric_struct_asks_for_version_2() {
        let info = empty_fabric_info_v();
        assert_eq!(info.version, 0x0200_0024);
        // Nothing written yet reads as "not supported", never as a completed registration.
        assert_eq!(nvlink_domain(&fabric_from_v(&info)), None);
        assert_eq!(nvlink_domain(&fabric_from_v1(&empty_fabric_info())), None);
    }

    #[test]
    fn fabric_structs_become_raw_fabric() {
        let mut v = empty_fabric_info_v();
        v.clusterUuid = CLUSTER;
        v.cliqueId = 32766;
        v.state = 3;
        v.healthMask = 0x1aa;
        let raw = fabric_from_v(&v);
        assert_eq!(
            raw,
            RawFabric {
                cluster_uuid: CLUSTER,
                clique_id: 32766,
                state: 3,
                status: 0
            }
        );
        assert_eq!(
            nvlink_domain(&raw).as_deref(),
            Some("6f1c2a8e-4b7d-4e19-9a3c-52d0e8f1b764.32766")
        );
        let v1 = nvmlGpuFabricInfo_t {
            clusterUuid: CLUSTER,
            status: 0,
            cliqueId: 1,
            state: u8::try_from(NVML_GPU_FABRIC_STATE_IN_PROGRESS).unwrap(),
        };
        let raw = fabric_from_v1(&v1);
        assert_eq!((raw.clique_id, raw.state), (1, 2));
        assert_eq!(nvlink_domain(&raw), None);
    }

    #[test]
    fn placements_are_checked() {
        let mut info = empty_gpu_instance_info();
        info.id = 5;
        info.placement = nvmlGpuInstancePlacement_t { start: 4, size: 2 };
        assert_eq!(
            placement_from_info(5, &info).unwrap(),
            MigPlacement { start: 4, size: 2 }
        );
        assert!(matches!(
            placement_from_info(6, &info),
            Err(Error::Nvml(m)) if m.contains("instance 6") && m.contains("instance 5")
        ));
        info.placement.size = 0;
        assert!(matches!(
            placement_from_info(5, &info),
            Err(Error::Nvml(m)) if m.contains("empty placement")
        ));
    }
}
