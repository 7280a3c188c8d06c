//! What the benchmarks read from /proc: resident memory, CPU time and file system types.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::{Error, Result};

/// Resident set size in bytes of process `pid` (`None`: this process), from the `VmRSS`
/// line of `/proc/<pid>/status`.
///
/// # Errors
/// The status file cannot be read or has no `VmRSS` line.
pub(crate) fn rss_bytes(pid: Option<u32>) -> Result<u64> {
    let path = match pid {
        Some(pid) => PathBuf::from(format!("/proc/{pid}/status")),
        None => PathBuf::from("/proc/self/status"),
    };
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io("read", &path, e))?;
    parse_vm_rss(&text).ok_or_else(|| {
        Error::io(
            "parse VmRSS",
            &path,
            std::io::Error::new(std::io::ErrorKind::InvalidData, "no VmRSS line"),
        )
    })
}

/// The `VmRSS:   1234 kB` line of a status file, in bytes.
pub(crate) fn parse_vm_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let mut parts = line["VmRSS:".len()..].split_whitespace();
    let value: u64 = parts.next()?.parse().ok()?;
    match parts.next() {
        Some("kB") | None => value.checked_mul(1024),
        Some(_) => None,
    }
}

/// CPU time (user + system, every thread) this process has used so far, from
/// `/proc/self/stat`.
///
/// # Errors
/// The stat file cannot be read or parsed.
pub(crate) fn cpu_time() -> Result<Duration> {
    let path = Path::new("/proc/self/stat");
    let text = std::fs::read_to_string(path).map_err(|e| Error::io("read", path, e))?;
    parse_cpu_time(&text).ok_or_else(|| {
        Error::io(
            "parse utime/stime",
            path,
            std::io::Error::new(std::io::ErrorKind::InvalidData, "malformed stat line"),
        )
    })
}

/// `utime + stime` of a `/proc/<pid>/stat` line (fields 14 and 15, after the parenthesised
/// command name, which may contain spaces), in clock ticks of `USER_HZ`, which the kernel
/// fixes at 100 per second for this interface.
pub(crate) fn parse_cpu_time(stat: &str) -> Option<Duration> {
    const USER_HZ: u64 = 100;
    let after_name = &stat[stat.rfind(')')? + 1..];
    // Field 3 (state) is the first after the name: utime and stime are fields 14 and 15.
    let mut fields = after_name.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(Duration::from_millis((utime + stime) * 1000 / USER_HZ))
}

/// The type of the file system holding `path` (e.g. `ext4`, `tmpfs`), from the longest
/// mount point in `/proc/self/mounts` that contains it.
///
/// # Errors
/// `path` cannot be resolved or the mount table cannot be read.
pub(crate) fn fs_type(path: &Path) -> Result<String> {
    let path = path
        .canonicalize()
        .map_err(|e| Error::io("resolve", path, e))?;
    let mounts_path = Path::new("/proc/self/mounts");
    let mounts =
        std::fs::read_to_string(mounts_path).map_err(|e| Error::io("read", mounts_path, e))?;
    Ok(fs_type_in(&mounts, &path).unwrap_or_else(|| "unknown".to_owned()))
}

/// [`fs_type`] over the text of a mount table.
pub(crate) fn fs_type_in(mounts: &str, path: &Path) -> Option<String> {
    mounts
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let _device = fields.next()?;
            let mount_point = unescape_mount_field(fields.next()?);
            let fs_type = fields.next()?;
            path.starts_with(&mount_point)
                .then(|| (mount_point.components().count(), fs_type.to_owned()))
        })
        // The last of equally long mount points is the one mounted on top.
        .max_by_key(|(depth, _)| *depth)
        .map(|(_, fs_type)| fs_type)
}

/// Mount tables escape space, tab, newline and backslash as octal `\ooo`.
fn unescape_mount_field(field: &str) -> PathBuf {
    let mut out = String::with_capacity(field.len());
    let mut rest = field;
    while let Some(at) = rest.find('\\') {
        out.push_str(&rest[..at]);
        let code = rest.get(at + 1..at + 4);
        if let Some(byte) = code.and_then(|c| u8::from_str_radix(c, 8).ok()) {
            out.push(char::from(byte));
            rest = &rest[at + 4..];
        } else {
            out.push('\\');
            rest = &rest[at + 1..];
        }
    }
    out.push_str(rest);
    PathBuf::from(out)
}

/// File systems that keep everything in memory: fsync on them is free.
pub(crate) fn is_memory_fs(fs_type: &str) -> bool {
    matches!(fs_type, "tmpfs" | "ramfs" | "devtmpfs")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_rss_in_bytes() {
        let status = "Name:\tkerf\nVmPeak:\t  9000 kB\nVmRSS:\t    5120 kB\nThreads:\t3\n";
        assert_eq!(parse_vm_rss(status), Some(5 << 20));
        assert_eq!(parse_vm_rss("Name:\tx\n"), None);
        assert_eq!(parse_vm_rss("VmRSS:\t 12 MB\n"), None);
    }

    #[test]
    fn cpu_time_is_utime_plus_stime() {
        let stat = "42 (kerf bench) S 1 42 42 0 -1 4194304 100 0 0 0 250 30 0 0 20 0 9 0 1 2 3";
        assert_eq!(parse_cpu_time(stat), Some(Duration::from_millis(2800)));
        assert_eq!(parse_cpu_time("garbage"), None);
        assert!(cpu_time().is_ok());
    }

    #[test]
    fn this_process_has_some_resident_memory() {
        assert!(rss_bytes(None).unwrap() > 0);
    }

    #[test]
    fn the_longest_mount_point_wins() {
        let mounts = "\
/dev/vda / ext4 rw 0 0
tmpfs /tmp tmpfs rw 0 0
tmpfs /work/main/target/with\\040space tmpfs rw 0 0
/dev/vdb /work xfs rw 0 0
";
        let t = |p: &str| fs_type_in(mounts, Path::new(p));
        assert_eq!(t("/tmp/x").as_deref(), Some("tmpfs"));
        assert_eq!(t("/tmpx").as_deref(), Some("ext4"));
        assert_eq!(t("/work/main/target").as_deref(), Some("xfs"));
        assert_eq!(
            t("/work/main/target/with space/a").as_deref(),
            Some("tmpfs")
        );
        assert!(is_memory_fs("tmpfs"));
        assert!(!is_memory_fs("ext4"));
    }
}
