//! Raw NVML calls for the GPU-instance profiles a GPU offers and where their instances may
//! be placed (dynamic MIG's catalogue). The soundness points are the parent module's and
//! [`super::mig`]'s (arrays 2', names 4').

use std::os::raw::{c_char, c_uint};
use std::ptr;

use kerf_core::inventory::MigPlacement;
use nvml_wrapper::Device;
use nvml_wrapper_sys::bindings::{
    NVML_GPU_INSTANCE_PROFILE_COUNT, NvmlLib, nvmlDevice_t, nvmlGpuInstancePlacement_t,
    nvmlGpuInstanceProfileInfo_t, nvmlGpuInstanceProfileInfo_v2_t,
    nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND, nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT,
    nvmlReturn_t,
};

use super::mig::{MigResult, RawMigError, check, required};
use super::{Outcome, classify};
use crate::discovery::facts::RawGiProfile;

/// `nvmlGpuInstanceProfileInfo_v2` from `nvml.h`:
/// `NVML_STRUCT_VERSION(GpuInstanceProfileInfo, 2)`.
const GI_PROFILE_INFO_V2: c_uint = (2 << 24) | 0x98;

const _: () = {
    assert!(size_of::<nvmlGpuInstanceProfileInfo_v2_t>() == 152);
    assert!(size_of::<nvmlGpuInstanceProfileInfo_t>() == 48);
};

/// Whether NVML answered that the GPU has no such profile (`NOT_SUPPORTED`,
/// `INVALID_ARGUMENT`), which NVIDIA's driver skips silently (kubernetes-sigs/
/// dra-driver-nvidia-gpu `cmd/gpu-kubelet-plugin/nvlib.go` (`getGpuInfo`)).
pub(super) fn no_such_profile(code: nvmlReturn_t) -> bool {
    classify(code) == Outcome::NotSupported || code == nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT
}

/// Every GPU-instance profile the GPU `device` offers, with its placements; empty when the
/// driver lacks the calls.
///
/// # Errors
/// [`RawMigError`] when NVML fails a call for another reason than "no such profile".
pub(crate) fn gi_profiles(device: &Device<'_>) -> MigResult<Vec<RawGiProfile>> {
    let lib = device.nvml().lib();
    // SAFETY: reading the handle out of a borrowed `Device` (point 1).
    let handle = unsafe { device.handle() };
    let mut profiles = Vec::new();
    for index in 0..NVML_GPU_INSTANCE_PROFILE_COUNT {
        let Some(mut profile) = gi_profile_info(lib, handle, index)? else {
            continue;
        };
        match possible_placements(lib, handle, profile.id) {
            Ok(placements) => profile.placements = placements,
            Err(error) if no_such_profile(error.code) => continue,
            Err(error) if error.code == nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND => {
                return Ok(Vec::new());
            }
            Err(error) => return Err(error),
        }
        profiles.push(profile);
    }
    Ok(profiles)
}

/// Profile `index` of the GPU, from the versioned call (which has the name) or the plain one;
/// `None` when the GPU has no such profile or the driver neither call.
pub(super) fn gi_profile_info(
    lib: &NvmlLib,
    handle: nvmlDevice_t,
    index: c_uint,
) -> MigResult<Option<RawGiProfile>> {
    const CALL_V: &str = "nvmlDeviceGetGpuInstanceProfileInfoV";
    const CALL: &str = "nvmlDeviceGetGpuInstanceProfileInfo";
    if let Some(get_v) = super::symbol(CALL_V, &lib.nvmlDeviceGetGpuInstanceProfileInfoV) {
        let mut info = empty_gi_profile_info_v2();
        // SAFETY: a valid device handle and a function of the same library (point 1); the
        // out-pointer is a fully initialised version-2 struct whose `version` says so (point
        // 2), read only after success (point 3).
        let code = unsafe { get_v(handle, index, &raw mut info) };
        match classify(code) {
            Outcome::Success => return Ok(Some(profile_from_v2(index, &info))),
            Outcome::NotImplemented | Outcome::VersionMismatch => {}
            _ if no_such_profile(code) => return Ok(None),
            _ => return Err(RawMigError { call: CALL_V, code }),
        }
    }
    let Some(get) = super::symbol(CALL, &lib.nvmlDeviceGetGpuInstanceProfileInfo) else {
        return Ok(None);
    };
    let mut info = empty_gi_profile_info();
    // SAFETY: as for the versioned call above, with the unversioned struct (points 1–3).
    let code = unsafe { get(handle, index, &raw mut info) };
    match classify(code) {
        Outcome::Success => Ok(Some(profile_from_v1(index, &info))),
        Outcome::NotImplemented => Ok(None),
        _ if no_such_profile(code) => Ok(None),
        _ => Err(RawMigError { call: CALL, code }),
    }
}

/// Where instances of GPU-instance profile `profile_id` may be placed.
fn possible_placements(
    lib: &NvmlLib,
    handle: nvmlDevice_t,
    profile_id: c_uint,
) -> MigResult<Vec<MigPlacement>> {
    const CALL: &str = "nvmlDeviceGetGpuInstancePossiblePlacements_v2";
    let get = required(CALL, &lib.nvmlDeviceGetGpuInstancePossiblePlacements_v2)?;
    let mut count: c_uint = 0;
    // SAFETY: a valid device handle and a function of the same library (point 1); a null
    // array asks for the count only, which NVML writes to an initialised `c_uint` (point 2),
    // read only after success (point 3).
    let code = unsafe { get(handle, profile_id, ptr::null_mut(), &raw mut count) };
    check(CALL, code)?;
    if count == 0 {
        return Ok(Vec::new());
    }
    let mut placements = vec![nvmlGpuInstancePlacement_t { start: 0, size: 0 }; count as usize];
    let mut written = count;
    // SAFETY: as above, with an array of `count` initialised placements, the number NVML
    // just said it needs (point 2'); only the first `written` are kept (point 3).
    let code = unsafe {
        get(
            handle,
            profile_id,
            placements.as_mut_ptr(),
            &raw mut written,
        )
    };
    check(CALL, code)?;
    placements.truncate(written.min(count) as usize);
    Ok(placements
        .iter()
        .map(|p| MigPlacement {
            start: p.start,
            size: p.size,
        })
        .collect())
}

fn empty_gi_profile_info() -> nvmlGpuInstanceProfileInfo_t {
    nvmlGpuInstanceProfileInfo_t {
        id: 0,
        isP2pSupported: 0,
        sliceCount: 0,
        instanceCount: 0,
        multiprocessorCount: 0,
        copyEngineCount: 0,
        decoderCount: 0,
        encoderCount: 0,
        jpegCount: 0,
        ofaCount: 0,
        memorySizeMB: 0,
    }
}

fn empty_gi_profile_info_v2() -> nvmlGpuInstanceProfileInfo_v2_t {
    nvmlGpuInstanceProfileInfo_v2_t {
        version: GI_PROFILE_INFO_V2,
        id: 0,
        isP2pSupported: 0,
        sliceCount: 0,
        instanceCount: 0,
        multiprocessorCount: 0,
        copyEngineCount: 0,
        decoderCount: 0,
        encoderCount: 0,
        jpegCount: 0,
        ofaCount: 0,
        memorySizeMB: 0,
        name: [0; 96],
    }
}

fn profile_from_v1(index: u32, info: &nvmlGpuInstanceProfileInfo_t) -> RawGiProfile {
    RawGiProfile {
        profile_index: index,
        id: info.id,
        name: None,
        slice_count: info.sliceCount,
        instance_count: info.instanceCount,
        multiprocessors: info.multiprocessorCount,
        copy_engines: info.copyEngineCount,
        decoders: info.decoderCount,
        encoders: info.encoderCount,
        jpegs: info.jpegCount,
        ofas: info.ofaCount,
        memory_size_mib: info.memorySizeMB,
        placements: Vec::new(),
    }
}

fn profile_from_v2(index: u32, info: &nvmlGpuInstanceProfileInfo_v2_t) -> RawGiProfile {
    RawGiProfile {
        profile_index: index,
        id: info.id,
        name: c_name(&info.name),
        slice_count: info.sliceCount,
        instance_count: info.instanceCount,
        multiprocessors: info.multiprocessorCount,
        copy_engines: info.copyEngineCount,
        decoders: info.decoderCount,
        encoders: info.encoderCount,
        jpegs: info.jpegCount,
        ofas: info.ofaCount,
        memory_size_mib: info.memorySizeMB,
        placements: Vec::new(),
    }
}

/// A fixed-size C string field up to its first NUL or its end (point 4'); `None` when empty
/// or not UTF-8.
fn c_name(field: &[c_char]) -> Option<String> {
    let bytes: Vec<u8> = field
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c.to_ne_bytes()[0])
        .collect();
    String::from_utf8(bytes).ok().filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_versions_and_names() {
        let size = u32::try_from(size_of::<nvmlGpuInstanceProfileInfo_v2_t>()).unwrap();
        assert_eq!(GI_PROFILE_INFO_V2, size | (2 << 24));
        let mut info = empty_gi_profile_info_v2();
        assert_eq!(profile_from_v2(0, &info).name, None);
        for (slot, byte) in info.name.iter_mut().zip(b"MIG 1g.5gb+me") {
            *slot = c_char::from_ne_bytes([*byte]);
        }
        info.id = 20;
        info.sliceCount = 1;
        let profile = profile_from_v2(7, &info);
        assert_eq!(profile.name.as_deref(), Some("MIG 1g.5gb+me"));
        assert_eq!(
            (profile.profile_index, profile.id, profile.slice_count),
            (7, 20, 1)
        );
        // No terminator: the whole array, never beyond it.
        info.name = [c_char::from_ne_bytes([b'x']); 96];
        assert_eq!(profile_from_v2(7, &info).name.map(|n| n.len()), Some(96));
    }

    #[test]
    fn no_such_profile_is_not_supported_or_invalid_argument() {
        assert!(no_such_profile(3) && no_such_profile(2));
        assert!(!no_such_profile(6) && !no_such_profile(0));
    }
}
