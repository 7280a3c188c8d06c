//! The suite's settings, read from the environment once per test.

use std::time::Duration;

use anyhow::{Context as _, Result, bail};

/// Driver name kerf publishes under unless `KERF_E2E_DRIVER` says otherwise.
pub const DEFAULT_DRIVER: &str = "gpu.kerf.dev";
/// A small image with `sh`, `env`, `ls` and `sleep`.
pub const DEFAULT_IMAGE: &str = "busybox:1.36";
/// The kubectl the install test runs unless `KERF_E2E_KUBECTL` says otherwise.
pub const DEFAULT_KUBECTL: &str = "kubectl";
/// The helm the chart tests run unless `KERF_E2E_HELM` says otherwise.
pub const DEFAULT_HELM: &str = "helm";
/// The chart tests' `--set` values unless `KERF_E2E_HELM_SET` says otherwise: mock GPUs and
/// the locally built image `kerf:dev`.
pub const DEFAULT_HELM_SET: &str = "gpus.source=mock,image.repository=kerf,image.tag=dev";
/// Pull policy unless `KERF_E2E_PULL_POLICY` says otherwise.
pub const DEFAULT_PULL_POLICY: &str = "IfNotPresent";
/// Bound of every wait unless `KERF_E2E_TIMEOUT` (seconds) says otherwise. Generous because
/// the first pod on a node may have to pull the image.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(180);

const PULL_POLICIES: [&str; 3] = ["Always", "IfNotPresent", "Never"];

/// What the suite needs to know about the cluster it runs against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// kerf's driver name (`KERF_E2E_DRIVER`).
    pub driver: String,
    /// Container image of the test pods (`KERF_E2E_IMAGE`).
    pub image: String,
    /// `imagePullPolicy` of the test pods (`KERF_E2E_PULL_POLICY`).
    pub pull_policy: String,
    /// Bound of each wait (`KERF_E2E_TIMEOUT`, seconds).
    pub timeout: Duration,
    /// The kubectl the install test runs (`KERF_E2E_KUBECTL`); it reads `KUBECONFIG` as the
    /// suite does.
    pub kubectl: String,
    /// The helm the chart tests run (`KERF_E2E_HELM`), with the suite's `KUBECONFIG`.
    pub helm: String,
    /// The chart tests' values, one `--set` argument (`KERF_E2E_HELM_SET`).
    pub helm_set: String,
}

impl Settings {
    /// Reads the settings from the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the settings through `lookup`; empty values count as unset.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let get = |name: &str, default: &str| {
            lookup(name)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| default.to_owned())
        };
        let pull_policy = get("KERF_E2E_PULL_POLICY", DEFAULT_PULL_POLICY);
        if !PULL_POLICIES.contains(&pull_policy.as_str()) {
            bail!("KERF_E2E_PULL_POLICY={pull_policy:?}: expected one of {PULL_POLICIES:?}");
        }
        let timeout = match lookup("KERF_E2E_TIMEOUT").filter(|v| !v.trim().is_empty()) {
            None => DEFAULT_TIMEOUT,
            Some(text) => {
                let secs: u64 = text.trim().parse().with_context(|| {
                    format!("KERF_E2E_TIMEOUT={text:?}: expected a whole number of seconds")
                })?;
                if secs == 0 {
                    bail!("KERF_E2E_TIMEOUT=0: a wait needs at least one second");
                }
                Duration::from_secs(secs)
            }
        };
        Ok(Settings {
            driver: get("KERF_E2E_DRIVER", DEFAULT_DRIVER),
            image: get("KERF_E2E_IMAGE", DEFAULT_IMAGE),
            pull_policy,
            timeout,
            kubectl: get("KERF_E2E_KUBECTL", DEFAULT_KUBECTL),
            helm: get("KERF_E2E_HELM", DEFAULT_HELM),
            helm_set: get("KERF_E2E_HELM_SET", DEFAULT_HELM_SET),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn settings(vars: &[(&str, &str)]) -> Result<Settings> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Settings::from_lookup(|name| map.get(name).cloned())
    }

    #[test]
    fn defaults_apply_when_nothing_is_set() {
        let s = settings(&[]).unwrap();
        assert_eq!(s.driver, "gpu.kerf.dev");
        assert_eq!(s.image, "busybox:1.36");
        assert_eq!(s.pull_policy, "IfNotPresent");
        assert_eq!(s.timeout, DEFAULT_TIMEOUT);
        assert_eq!(s.kubectl, "kubectl");
        assert_eq!(s.helm, "helm");
        assert_eq!(s.helm_set, DEFAULT_HELM_SET);
        assert_eq!(
            settings(&[("KERF_E2E_IMAGE", "  ")]).unwrap().image,
            DEFAULT_IMAGE
        );
    }

    #[test]
    fn environment_overrides_are_taken_and_checked() {
        let s = settings(&[
            ("KERF_E2E_DRIVER", "gpu.example.com"),
            ("KERF_E2E_IMAGE", "registry.local/busybox:1.36"),
            ("KERF_E2E_PULL_POLICY", "Never"),
            ("KERF_E2E_TIMEOUT", "30"),
            ("KERF_E2E_KUBECTL", "/opt/bin/kubectl"),
        ])
        .unwrap();
        assert_eq!(s.kubectl, "/opt/bin/kubectl");
        assert_eq!(s.driver, "gpu.example.com");
        assert_eq!(s.image, "registry.local/busybox:1.36");
        assert_eq!(s.pull_policy, "Never");
        assert_eq!(s.timeout, Duration::from_secs(30));

        let bad = settings(&[("KERF_E2E_PULL_POLICY", "never")]).unwrap_err();
        assert!(bad.to_string().contains("KERF_E2E_PULL_POLICY"), "{bad}");
        assert!(settings(&[("KERF_E2E_TIMEOUT", "2m")]).is_err());
        assert!(settings(&[("KERF_E2E_TIMEOUT", "0")]).is_err());
    }
}
