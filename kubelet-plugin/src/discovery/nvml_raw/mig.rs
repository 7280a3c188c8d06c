//! Raw NVML calls for GPU and compute instances: what dynamic MIG makes and destroys at
//! prepare and unprepare and lists at start-up. nvml-wrapper 0.13
//! wraps none of them except the profile info and `possible_placements`, which never sets its
//! vector's length and so always answers an empty list.
//!
//! The soundness points 1–4 of the parent module apply, with two additions:
//! - **Arrays** (point 2'): for the calls that fill an array (`…PossiblePlacements_v2`,
//!   `nvmlDeviceGetGpuInstances`, `nvmlGpuInstanceGetComputeInstances`) kerf passes a `Vec`
//!   of initialised elements that is as long as NVML says it must be (the count of a first
//!   call with a null array, or the profile's `instanceCount`) and its length as the count,
//!   and keeps only as many elements as NVML says it wrote, never more than the `Vec` holds.
//!   NVIDIA's Go bindings size the arrays the same way (NVIDIA/go-nvml `pkg/nvml/device.go`
//!   (`GetGpuInstancePossiblePlacements`, `GetGpuInstances`), `pkg/nvml/gpu_instance.go`
//!   (`GetComputeInstances`)).
//! - **Names** (point 4'): the profile name of `nvmlGpuInstanceProfileInfo_v2_t` is a fixed
//!   96-byte array inside a struct kerf owns; it is read up to its first NUL or its end, so a
//!   missing terminator cannot make kerf read past it.
//!
//! GPU and compute instance handles are used at once and never stored (point 1). Every call
//! here returns [`RawMigError`] with the call's name and NVML's return code on failure, so
//! that the caller can tell the failures it acts on (not found, placement taken, in use)
//! from the others.

use std::ptr;

use kerf_core::inventory::MigPlacement;
use kerf_core::mig_reconcile::{LiveComputeInstance, LiveGpuInstance};
use nvml_wrapper::Device;
use nvml_wrapper_sys::bindings::{
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, NVML_COMPUTE_INSTANCE_PROFILE_COUNT,
    NVML_GPU_INSTANCE_PROFILE_COUNT, NvmlLib, nvmlComputeInstance_t, nvmlComputeInstanceInfo_t,
    nvmlComputeInstancePlacement_t, nvmlComputeInstanceProfileInfo_t, nvmlGpuInstance_t,
    nvmlGpuInstancePlacement_t, nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND,
    nvmlReturn_enum_NVML_ERROR_UNKNOWN, nvmlReturn_t,
};

use super::profiles::{gi_profile_info, no_such_profile};
use super::{Outcome, classify, empty_gpu_instance_info};

const _: () = {
    assert!(size_of::<nvmlComputeInstanceProfileInfo_t>() == 36);
    assert!(size_of::<nvmlComputeInstanceInfo_t>() == 2 * size_of::<*mut ()>() + 16);
    assert!(size_of::<nvmlGpuInstancePlacement_t>() == 8);
};

/// A MIG call NVML refused: which call, and its return code (`NVML_ERROR_FUNCTION_NOT_FOUND`
/// when the loaded library lacks the symbol).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RawMigError {
    /// The NVML function.
    pub call: &'static str,
    /// Its return code.
    pub code: nvmlReturn_t,
}

pub(crate) type MigResult<T> = Result<T, RawMigError>;

pub(super) fn check(call: &'static str, code: nvmlReturn_t) -> MigResult<()> {
    if classify(code) == Outcome::Success {
        Ok(())
    } else {
        Err(RawMigError { call, code })
    }
}

/// The entry point, or [`RawMigError`] with `NVML_ERROR_FUNCTION_NOT_FOUND`: a MIG change
/// cannot go without its call.
pub(super) fn required<F: Copy, E: std::fmt::Display>(
    call: &'static str,
    entry: &Result<F, E>,
) -> MigResult<F> {
    super::symbol(call, entry).ok_or(RawMigError {
        call,
        code: nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND,
    })
}

/// Creates a GPU instance of profile id `profile_id` at `placement` on `device`; returns its
/// GPU instance id.
///
/// # Errors
/// [`RawMigError`] of the failed call (`INSUFFICIENT_RESOURCES` for a taken placement).
pub(crate) fn create_gpu_instance(
    device: &Device<'_>,
    profile_id: u32,
    placement: MigPlacement,
) -> MigResult<u32> {
    const CALL: &str = "nvmlDeviceCreateGpuInstanceWithPlacement";
    let lib = device.nvml().lib();
    let create = required(CALL, &lib.nvmlDeviceCreateGpuInstanceWithPlacement)?;
    // SAFETY: reading the handle out of a borrowed `Device` (point 1).
    let handle = unsafe { device.handle() };
    let wanted = nvmlGpuInstancePlacement_t {
        start: placement.start,
        size: placement.size,
    };
    let mut instance: nvmlGpuInstance_t = ptr::null_mut();
    // SAFETY: a valid device handle and a function of the same library (point 1); the
    // placement is a local NVML only reads, the out-pointer an initialised null handle
    // (point 2), used only after success and a null check (point 3).
    let code = unsafe { create(handle, profile_id, &raw const wanted, &raw mut instance) };
    check(CALL, code)?;
    gpu_instance_info(lib, instance).map(|(id, _, _)| id)
}

/// The id, profile id and placement of the GPU instance `instance`, a handle NVML returned.
fn gpu_instance_info(
    lib: &NvmlLib,
    instance: nvmlGpuInstance_t,
) -> MigResult<(u32, u32, MigPlacement)> {
    const CALL: &str = "nvmlGpuInstanceGetInfo";
    if instance.is_null() {
        return Err(RawMigError {
            call: CALL,
            code: nvmlReturn_enum_NVML_ERROR_UNKNOWN,
        });
    }
    let get_info = required(CALL, &lib.nvmlGpuInstanceGetInfo)?;
    let mut info = empty_gpu_instance_info();
    // SAFETY: a non-null GPU instance handle NVML just returned (point 1); the out-pointer
    // is a fully initialised struct (point 2), read only after success (point 3).
    let code = unsafe { get_info(instance, &raw mut info) };
    check(CALL, code)?;
    Ok((
        info.id,
        info.profileId,
        MigPlacement {
            start: info.placement.start,
            size: info.placement.size,
        },
    ))
}

/// The handle of GPU instance `gi_id` of `device`, checked non-null; use it at once.
fn gpu_instance(device: &Device<'_>, gi_id: u32) -> MigResult<nvmlGpuInstance_t> {
    const CALL: &str = "nvmlDeviceGetGpuInstanceById";
    let get = required(CALL, &device.nvml().lib().nvmlDeviceGetGpuInstanceById)?;
    // SAFETY: reading the handle out of a borrowed `Device` (point 1).
    let handle = unsafe { device.handle() };
    let mut instance: nvmlGpuInstance_t = ptr::null_mut();
    // SAFETY: a valid device handle and a function of the same library (point 1); the
    // out-pointer is an initialised null handle (point 2), checked after success (point 3).
    let code = unsafe { get(handle, gi_id, &raw mut instance) };
    check(CALL, code)?;
    if instance.is_null() {
        return Err(RawMigError {
            call: CALL,
            code: nvmlReturn_enum_NVML_ERROR_UNKNOWN,
        });
    }
    Ok(instance)
}

/// Creates, in GPU instance `gi_id`, a compute instance of compute-instance profile index
/// `ci_profile_index` (`NVML_COMPUTE_INSTANCE_PROFILE_*`, shared engines); returns its id
/// and, when NVML hands out the MIG device handle with it, the MIG device's UUID.
///
/// # Errors
/// [`RawMigError`] of the failed call (`NOT_FOUND` when the GPU instance is gone).
pub(crate) fn create_compute_instance(
    device: &Device<'_>,
    gi_id: u32,
    ci_profile_index: u32,
) -> MigResult<(u32, Option<String>)> {
    const CALL: &str = "nvmlGpuInstanceCreateComputeInstance";
    let lib = device.nvml().lib();
    let create = required(CALL, &lib.nvmlGpuInstanceCreateComputeInstance)?;
    let gi = gpu_instance(device, gi_id)?;
    let profile = ci_profile_info(lib, gi, ci_profile_index)?;
    let mut ci: nvmlComputeInstance_t = ptr::null_mut();
    // SAFETY: a live GPU instance handle NVML just returned (point 1); the out-pointer is an
    // initialised null handle (point 2), used only after success and a null check (point 3).
    let code = unsafe { create(gi, profile.id, &raw mut ci) };
    check(CALL, code)?;
    compute_instance_info(device, ci)
}

/// Compute-instance profile `index` (shared engines) of GPU instance `gi`.
fn ci_profile_info(
    lib: &NvmlLib,
    gi: nvmlGpuInstance_t,
    index: u32,
) -> MigResult<nvmlComputeInstanceProfileInfo_t> {
    const CALL: &str = "nvmlGpuInstanceGetComputeInstanceProfileInfo";
    let get = required(CALL, &lib.nvmlGpuInstanceGetComputeInstanceProfileInfo)?;
    let mut info = nvmlComputeInstanceProfileInfo_t {
        id: 0,
        sliceCount: 0,
        instanceCount: 0,
        multiprocessorCount: 0,
        sharedCopyEngineCount: 0,
        sharedDecoderCount: 0,
        sharedEncoderCount: 0,
        sharedJpegCount: 0,
        sharedOfaCount: 0,
    };
    // SAFETY: a live GPU instance handle NVML returned (point 1); the out-pointer is a fully
    // initialised struct (point 2), read only after success (point 3).
    let code = unsafe {
        get(
            gi,
            index,
            NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
            &raw mut info,
        )
    };
    check(CALL, code)?;
    Ok(info)
}

/// The id of compute instance `ci` and, when the handle NVML reports with it is a MIG
/// device handle, that MIG device's UUID (`None` otherwise: the caller finds it by ids).
fn compute_instance_info(
    device: &Device<'_>,
    ci: nvmlComputeInstance_t,
) -> MigResult<(u32, Option<String>)> {
    const CALL: &str = "nvmlComputeInstanceGetInfo_v2";
    if ci.is_null() {
        return Err(RawMigError {
            call: CALL,
            code: nvmlReturn_enum_NVML_ERROR_UNKNOWN,
        });
    }
    let get = required(CALL, &device.nvml().lib().nvmlComputeInstanceGetInfo_v2)?;
    let mut info = nvmlComputeInstanceInfo_t {
        device: ptr::null_mut(),
        gpuInstance: ptr::null_mut(),
        id: 0,
        profileId: 0,
        placement: nvmlComputeInstancePlacement_t { start: 0, size: 0 },
    };
    // SAFETY: a non-null compute instance handle NVML just returned (point 1); the
    // out-pointer is a fully initialised struct (point 2), read only after success (point 3).
    let code = unsafe { get(ci, &raw mut info) };
    check(CALL, code)?;
    if info.device.is_null() {
        return Ok((info.id, None));
    }
    // SAFETY: a non-null device handle NVML returned for a live compute instance, wrapped
    // with the `Nvml` that the borrowed parent `device` belongs to (point 1); the wrapper is
    // dropped before this function returns.
    let mig = unsafe { Device::new(info.device, device.nvml()) };
    let uuid = match mig.mig_is_mig_device_handle() {
        Ok(true) => mig.uuid().ok(),
        _ => None,
    };
    Ok((info.id, uuid))
}

/// The UUID of the MIG device made of GPU instance `gi_id` and compute instance `ci_id` of
/// `parent`, found among its MIG device handles (`nvmlDeviceGetMigDeviceHandleByIndex`), as
/// NVIDIA's driver finds MIG devices (kubernetes-sigs/dra-driver-nvidia-gpu
/// `cmd/gpu-kubelet-plugin/nvlib.go` (`walkMigDevices`)); `None` when none matches.
pub(crate) fn mig_uuid_by_ids(parent: &Device<'_>, gi_id: u32, ci_id: u32) -> Option<String> {
    let max = parent.mig_device_count().ok()?;
    (0..max)
        .filter_map(|i| parent.mig_device_by_index(i).ok())
        .find(|mig| {
            matches!(super::mig_ids(mig), Ok(Some(ids)) if ids.gi_id == gi_id && ids.ci_id == ci_id)
        })
        .and_then(|mig| mig.uuid().ok())
}

/// Destroys compute instance `ci_id` of GPU instance `gi_id`.
///
/// # Errors
/// [`RawMigError`] of the failed call (`NOT_FOUND` when either is gone, `IN_USE`).
pub(crate) fn destroy_compute_instance(
    device: &Device<'_>,
    gi_id: u32,
    ci_id: u32,
) -> MigResult<()> {
    const GET: &str = "nvmlGpuInstanceGetComputeInstanceById";
    const CALL: &str = "nvmlComputeInstanceDestroy";
    let lib = device.nvml().lib();
    let get = required(GET, &lib.nvmlGpuInstanceGetComputeInstanceById)?;
    let destroy = required(CALL, &lib.nvmlComputeInstanceDestroy)?;
    let gi = gpu_instance(device, gi_id)?;
    let mut ci: nvmlComputeInstance_t = ptr::null_mut();
    // SAFETY: a live GPU instance handle NVML just returned (point 1); the out-pointer is an
    // initialised null handle (point 2), used only after success and a null check (point 3).
    let code = unsafe { get(gi, ci_id, &raw mut ci) };
    check(GET, code)?;
    if ci.is_null() {
        return Err(RawMigError {
            call: GET,
            code: nvmlReturn_enum_NVML_ERROR_UNKNOWN,
        });
    }
    // SAFETY: a non-null compute instance handle NVML just returned, not used afterwards
    // (point 1).
    let code = unsafe { destroy(ci) };
    check(CALL, code)
}

/// Destroys GPU instance `gi_id`.
///
/// # Errors
/// [`RawMigError`] of the failed call (`NOT_FOUND` when it is gone, `IN_USE` while it has
/// compute instances).
pub(crate) fn destroy_gpu_instance(device: &Device<'_>, gi_id: u32) -> MigResult<()> {
    const CALL: &str = "nvmlGpuInstanceDestroy";
    let destroy = required(CALL, &device.nvml().lib().nvmlGpuInstanceDestroy)?;
    let gi = gpu_instance(device, gi_id)?;
    // SAFETY: a live GPU instance handle NVML just returned, not used afterwards (point 1).
    let code = unsafe { destroy(gi) };
    check(CALL, code)
}

/// The GPU instances of `device`, every profile, with their compute instances.
///
/// # Errors
/// [`RawMigError`] of the first call that failed.
pub(crate) fn gpu_instances(device: &Device<'_>) -> MigResult<Vec<LiveGpuInstance>> {
    const CALL: &str = "nvmlDeviceGetGpuInstances";
    let lib = device.nvml().lib();
    let get = required(CALL, &lib.nvmlDeviceGetGpuInstances)?;
    // SAFETY: reading the handle out of a borrowed `Device` (point 1).
    let handle = unsafe { device.handle() };
    let mut live = Vec::new();
    for index in 0..NVML_GPU_INSTANCE_PROFILE_COUNT {
        let Some(profile) = gi_profile_info(lib, handle, index)? else {
            continue;
        };
        let capacity = profile.instance_count;
        let mut instances: Vec<nvmlGpuInstance_t> = vec![ptr::null_mut(); capacity as usize];
        let mut written = capacity;
        // SAFETY: a valid device handle and a function of the same library (point 1); an
        // array of `instanceCount` initialised null handles, as the profile says NVML needs
        // (point 2'); only the first `written` are kept and each is checked (point 3).
        let code = unsafe { get(handle, profile.id, instances.as_mut_ptr(), &raw mut written) };
        if no_such_profile(code) {
            continue;
        }
        check(CALL, code)?;
        instances.truncate(written.min(capacity) as usize);
        for gi in instances {
            let (gi_id, gi_profile_id, placement) = gpu_instance_info(lib, gi)?;
            live.push(LiveGpuInstance {
                gi_id,
                gi_profile_id,
                placement,
                compute_instances: compute_instances(device, gi, gi_id)?,
            });
        }
    }
    live.sort_by_key(|gi| gi.gi_id);
    Ok(live)
}

/// The compute instances of GPU instance `gi` (id `gi_id`) of `device`, every profile.
fn compute_instances(
    device: &Device<'_>,
    gi: nvmlGpuInstance_t,
    gi_id: u32,
) -> MigResult<Vec<LiveComputeInstance>> {
    const CALL: &str = "nvmlGpuInstanceGetComputeInstances";
    let lib = device.nvml().lib();
    let get = required(CALL, &lib.nvmlGpuInstanceGetComputeInstances)?;
    let mut live = Vec::new();
    for index in 0..NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
        let profile = match ci_profile_info(lib, gi, index) {
            Ok(profile) => profile,
            Err(error) if no_such_profile(error.code) => continue,
            Err(error) => return Err(error),
        };
        let capacity = profile.instanceCount;
        let mut instances: Vec<nvmlComputeInstance_t> = vec![ptr::null_mut(); capacity as usize];
        let mut written = capacity;
        // SAFETY: a live GPU instance handle NVML returned (point 1); an array of
        // `instanceCount` initialised null handles (point 2'); only the first `written` are
        // kept and each is checked (point 3).
        let code = unsafe { get(gi, profile.id, instances.as_mut_ptr(), &raw mut written) };
        check(CALL, code)?;
        instances.truncate(written.min(capacity) as usize);
        for ci in instances {
            let (ci_id, uuid) = compute_instance_info(device, ci)?;
            let uuid = uuid
                .or_else(|| mig_uuid_by_ids(device, gi_id, ci_id))
                .unwrap_or_default();
            live.push(LiveComputeInstance { ci_id, uuid });
        }
    }
    live.sort_by_key(|ci| ci.ci_id);
    Ok(live)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_calls_and_refusals_name_the_call() {
        let missing: Result<fn(), String> = Err("undefined symbol".into());
        assert_eq!(
            required("nvmlGpuInstanceDestroy", &missing),
            Err(RawMigError {
                call: "nvmlGpuInstanceDestroy",
                code: 13
            })
        );
        assert_eq!(check("f", 0), Ok(()));
        assert_eq!(
            check("f", 23),
            Err(RawMigError {
                call: "f",
                code: 23
            })
        );
    }
}
