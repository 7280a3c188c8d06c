//! Command-line flags of `kerf-controller`; every flag is also an environment variable.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, Parser};

use crate::backoff::BackoffConfig;
use crate::claims::ClaimSettings;
use crate::claims::ownership::OwnershipTiming;
use crate::config::{ControllerConfig, FIELD_MANAGER};
use crate::default_classes::DefaultClasses;
use crate::error::{Error, Result};
use crate::leader::LeaseConfig;
use crate::quota::QuotaSettings;
use crate::run::Config;
use crate::webhook::{Certificates, SelfSigned, WebhookConfig};

/// kerf controller: reconciles GpuClasses into DeviceClasses and allocates GPU slices to
/// ResourceClaims of Controller classes. Replicas elect a leader through a Lease; only the
/// leader writes.
#[derive(Debug, Clone, Parser)]
#[command(name = "kerf-controller", version)]
pub struct Args {
    /// DRA driver name whose devices, classes and claims this controller manages.
    #[arg(long, env = "KERF_DRIVER_NAME", default_value = "gpu.kerf.dev")]
    pub driver_name: String,

    /// Elect a leader through a Lease; switch off only when a single replica runs.
    #[arg(long, env = "KERF_LEADER_ELECT", default_value_t = true, action = ArgAction::Set)]
    pub leader_elect: bool,

    /// Name of the leader election Lease.
    #[arg(long, env = "KERF_LEASE_NAME", default_value = "kerf-controller")]
    pub lease_name: String,

    /// Namespace of the leader election Lease.
    #[arg(long, env = "KERF_LEASE_NAMESPACE", default_value = "kerf-system")]
    pub lease_namespace: String,

    /// How long the Lease is valid after a renewal; a standby takes over after that (whole seconds).
    #[arg(long, env = "KERF_LEASE_DURATION", default_value = "15s", value_parser = humantime::parse_duration)]
    pub lease_duration: Duration,

    /// How long the leader keeps leading while its renewals fail; less than --lease-duration.
    #[arg(long, env = "KERF_LEASE_RENEW_DEADLINE", default_value = "10s", value_parser = humantime::parse_duration)]
    pub lease_renew_deadline: Duration,

    /// How often the leader renews the Lease (whole seconds); less than --lease-renew-deadline.
    #[arg(long, env = "KERF_LEASE_RETRY_PERIOD", default_value = "2s", value_parser = humantime::parse_duration)]
    pub lease_retry_period: Duration,

    /// Holder identity of this replica in the Lease and in Events [default: the host name].
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,

    /// Address of the HTTP server for /metrics, /healthz and /readyz; empty to disable.
    #[arg(long, env = "KERF_METRICS_ADDRESS", default_value = "0.0.0.0:8080")]
    pub metrics_address: String,

    /// How often every object is reconciled even without a change.
    #[arg(long, env = "KERF_RESYNC_PERIOD", default_value = "10m", value_parser = humantime::parse_duration)]
    pub resync_period: Duration,

    /// Shortest time between two refreshes of the GpuClass statuses after claim or slice
    /// changes (their free memory and device counts lag at most this much).
    #[arg(long, env = "KERF_CLASS_STATUS_INTERVAL", default_value = "1s", value_parser = humantime::parse_duration)]
    pub class_status_interval: Duration,

    /// Retry delay after an object's first failed reconcile; it doubles with each further failure.
    #[arg(long, env = "KERF_BACKOFF_BASE", default_value = "1s", value_parser = humantime::parse_duration)]
    pub backoff_base: Duration,

    /// Longest retry delay after failed reconciles.
    #[arg(long, env = "KERF_BACKOFF_MAX", default_value = "5m", value_parser = humantime::parse_duration)]
    pub backoff_max: Duration,

    /// How long a node is avoided for a pod after the scheduler first cleared an allocation
    /// the controller made there; each further rejection of the same node for the same pod
    /// doubles it.
    #[arg(long, env = "KERF_REJECTION_BACKOFF", default_value = "5s", value_parser = humantime::parse_duration)]
    pub rejection_backoff: Duration,

    /// Longest time a node is avoided for a pod after repeated rejections.
    #[arg(long, env = "KERF_REJECTION_BACKOFF_MAX", default_value = "5m", value_parser = humantime::parse_duration)]
    pub rejection_backoff_max: Duration,

    /// After this many rejections of one pod's placements by kube-scheduler (still
    /// remembered), the controller stops placing the pod for a while and says so in a Warning;
    /// 0: no bound.
    #[arg(long, env = "KERF_MAX_NODE_REJECTIONS", default_value_t = 10)]
    pub max_node_rejections: u32,

    /// How long a pod whose claims the controller placed counts on its node (requests, host
    /// ports) before kube-scheduler binds it; 0: until it is bound, deleted or placed again.
    #[arg(long, env = "KERF_ASSUMED_POD_TTL", default_value = "5m", value_parser = humantime::parse_duration)]
    pub assumed_pod_ttl: Duration,

    /// The node label whose value names a node's pool in the `kerf_controller_pool_*` metrics
    /// (nodes without it are pool `unlabeled`).
    #[arg(long, env = "KERF_NODE_POOL_LABEL", default_value = kerf_api::node_pool::DEFAULT_NODE_POOL_LABEL)]
    pub node_pool_label: String,

    /// How often the fragmentation of each node pool, and the usage of each GPU, class and
    /// namespace, are measured for the metrics; 0: never.
    #[arg(long, env = "KERF_FRAGMENTATION_INTERVAL", default_value = "15s", value_parser = humantime::parse_duration)]
    pub fragmentation_interval: Duration,

    /// Keep the PreferNoSchedule taint `gpu.kerf.dev/idle-gpus` on the nodes with an idle kerf
    /// GPU, so that kube-scheduler places the pods without GPUs beside GPUs in use; false: take
    /// it off where it was put.
    #[arg(long, env = "KERF_IDLE_GPUS_TAINT", default_value_t = true, action = ArgAction::Set)]
    pub idle_gpus_taint: bool,

    /// How long after it observed a device republished as its own the controller waits before
    /// placing on it: allocations kube-scheduler decided earlier (between its Reserve and
    /// PreBind) land within it.
    #[arg(long, env = "KERF_OWNERSHIP_SETTLE_PERIOD", default_value = "10s", value_parser = humantime::parse_duration)]
    pub ownership_settle_period: Duration,

    /// How long an idle device lent to kube-scheduler stays its own when no pod needs it and
    /// no controller claim waits.
    #[arg(long, env = "KERF_OWNERSHIP_LINGER", default_value = "30s", value_parser = humantime::parse_duration)]
    pub ownership_linger: Duration,

    /// Shortest time between two ownership passes. A pass runs only when something it reads
    /// changed (slices, claims, DeviceClasses, unbound pods, node labels, kerf's annotations,
    /// taints, readiness) or a fence or linger it computed expires.
    #[arg(long, env = "KERF_OWNERSHIP_TICK", default_value = "500ms", value_parser = humantime::parse_duration)]
    pub ownership_tick: Duration,

    /// When to try again to place a pod's claims after nothing fitted (sooner when capacity is
    /// freed).
    #[arg(long, env = "KERF_UNPLACEABLE_RETRY", default_value = "30s", value_parser = humantime::parse_duration)]
    pub unplaceable_retry: Duration,

    /// How often every GpuQuota's usage is recounted from the claims even without a change:
    /// the longest a quota stays wrong after a missed admission.
    #[arg(long, env = "KERF_QUOTA_RESYNC", default_value = "5m", value_parser = humantime::parse_duration)]
    pub quota_resync: Duration,

    /// How long a claim the webhook admitted counts in its GpuQuota's usage before the
    /// controller sees it (a create that failed after admission frees its share then).
    #[arg(long, env = "KERF_QUOTA_ADMITTED_GRACE", default_value = "60s", value_parser = humantime::parse_duration)]
    pub quota_admitted_grace: Duration,

    /// Serve the mutating admission webhook that puts the scheduling gate
    /// `gpu.kerf.dev/allocation` on pods with Controller-class claims, and checks and
    /// normalizes kerf's parameters in ResourceClaims and ResourceClaimTemplates being created
    /// (every replica serves it).
    #[arg(long, env = "KERF_WEBHOOK", default_value_t = true, action = ArgAction::Set)]
    pub webhook: bool,

    /// HTTPS address of the admission webhook.
    #[arg(long, env = "KERF_WEBHOOK_ADDRESS", default_value = "0.0.0.0:9443")]
    pub webhook_address: SocketAddr,

    /// The Service in front of the webhook; the self-made certificate is for
    /// `<service>.<namespace>.svc`.
    #[arg(long, env = "KERF_WEBHOOK_SERVICE", default_value = "kerf-webhook")]
    pub webhook_service: String,

    /// Namespace of the webhook's Service.
    #[arg(long, env = "KERF_WEBHOOK_NAMESPACE", default_value = "kerf-system")]
    pub webhook_namespace: String,

    /// The MutatingWebhookConfiguration of the pod webhook, whose caBundle the controller
    /// keeps (self-made certificates only).
    #[arg(
        long,
        env = "KERF_WEBHOOK_CONFIGURATION",
        default_value = "kerf-scheduling-gate"
    )]
    pub webhook_configuration: String,

    /// The MutatingWebhookConfiguration of the claim webhooks, whose caBundle the controller
    /// keeps too (self-made certificates only); empty: none.
    #[arg(
        long,
        env = "KERF_WEBHOOK_CLAIM_CONFIGURATION",
        default_value = "kerf-claim-parameters"
    )]
    pub webhook_claim_configuration: String,

    /// The ValidatingWebhookConfiguration of the GpuQuota webhook, whose caBundle the
    /// controller keeps too (self-made certificates only); empty: none.
    #[arg(
        long,
        env = "KERF_WEBHOOK_QUOTA_CONFIGURATION",
        default_value = "kerf-gpu-quota"
    )]
    pub webhook_quota_configuration: String,

    /// Directory with `tls.crt` and `tls.key` (e.g. a cert-manager Secret), reloaded when they
    /// change; then the controller makes no certificate and leaves caBundle alone.
    #[arg(long, env = "KERF_WEBHOOK_CERT_DIR")]
    pub webhook_cert_dir: Option<PathBuf>,

    /// Validity of each self-made webhook certificate (and its CA).
    #[arg(long, env = "KERF_WEBHOOK_CERT_VALIDITY", default_value = "24h", value_parser = humantime::parse_duration)]
    pub webhook_cert_validity: Duration,

    /// How long before its expiry a self-made webhook certificate is replaced.
    #[arg(long, env = "KERF_WEBHOOK_RENEW_BEFORE", default_value = "8h", value_parser = humantime::parse_duration)]
    pub webhook_renew_before: Duration,

    /// YAML file of GpuClasses (one per document) the leader creates when they do not exist;
    /// it never updates them, and never creates one again that it created before (an admin's
    /// deletion sticks). Recorded in the ConfigMap kerf-default-gpu-classes-created in
    /// --lease-namespace. Unset: no default classes.
    #[arg(long, env = "KERF_DEFAULT_GPU_CLASSES")]
    pub default_gpu_classes: Option<PathBuf>,

    /// Log format.
    #[arg(long, env = "KERF_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Log filter in tracing's EnvFilter syntax, e.g. `info,kerf_controller=debug`.
    #[arg(long, env = "KERF_LOG", default_value = "info")]
    pub log_filter: String,
}

pub use kerf_ops::logging::LogFormat;

impl Args {
    /// Checks the values and builds the configuration; `host_name` is the identity when
    /// `--identity` is not given.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the flag at fault: an invalid driver name, metrics address,
    /// lease timing, back-off or resync period, or no identity at all.
    pub fn into_config(self, host_name: Option<String>) -> Result<Config> {
        kerf_core::names::driver_name("--driver-name", &self.driver_name)
            .map_err(|e| Error::Config(e.to_string()))?;
        if self.resync_period.is_zero() || self.quota_resync.is_zero() {
            return Err(Error::Config(
                "--resync-period and --quota-resync must be positive".to_owned(),
            ));
        }
        if self.backoff_base.is_zero() || self.backoff_base > self.backoff_max {
            return Err(Error::Config(format!(
                "need 0 < --backoff-base ({:?}) <= --backoff-max ({:?})",
                self.backoff_base, self.backoff_max
            )));
        }
        let claims = self.claim_settings();
        let identity = self
            .identity
            .filter(|i| !i.is_empty())
            .or(host_name.filter(|h| !h.is_empty()));
        let leader_election = if self.leader_elect {
            let identity = identity.clone().ok_or_else(|| {
                Error::Config("no --identity (POD_NAME) and no host name to use instead".to_owned())
            })?;
            let lease = LeaseConfig {
                name: self.lease_name,
                namespace: self.lease_namespace,
                identity,
                lease_duration: self.lease_duration,
                renew_deadline: self.lease_renew_deadline,
                retry_period: self.lease_retry_period,
                field_manager: FIELD_MANAGER.to_owned(),
            };
            lease.validate()?;
            Some(lease)
        } else {
            None
        };
        Ok(Config {
            controller: ControllerConfig {
                claims,
                driver_name: self.driver_name,
                field_manager: FIELD_MANAGER.to_owned(),
                resync_period: self.resync_period,
                class_status_interval: self.class_status_interval,
                backoff: BackoffConfig {
                    base: self.backoff_base,
                    max: self.backoff_max,
                },
                instance: identity,
                quota: QuotaSettings {
                    resync: self.quota_resync,
                    admitted_grace: self.quota_admitted_grace,
                },
                node_pool_label: self.node_pool_label,
            },
            leader_election,
            metrics_address: parse_address(&self.metrics_address)?,
        })
    }

    /// The claim controller's timing the flags give.
    fn claim_settings(&self) -> ClaimSettings {
        ClaimSettings {
            rejection_backoff: self.rejection_backoff,
            rejection_backoff_max: self.rejection_backoff_max,
            unplaceable_retry: self.unplaceable_retry,
            ownership: OwnershipTiming {
                settle: self.ownership_settle_period,
                linger: self.ownership_linger,
            },
            ownership_tick: self.ownership_tick,
            assumed_pod_ttl: self.assumed_pod_ttl,
            max_node_rejections: self.max_node_rejections,
            fragmentation_interval: self.fragmentation_interval,
            idle_gpus_taint: self.idle_gpus_taint,
            ..ClaimSettings::default()
        }
    }
}

impl Args {
    /// The admission webhook's configuration; `None` when `--webhook false`.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the flag at fault: an empty service, namespace or
    /// configuration name, or a renewal not shorter than the validity.
    pub fn webhook_config(&self) -> Result<Option<WebhookConfig>> {
        if !self.webhook {
            return Ok(None);
        }
        let certificates = if let Some(dir) = &self.webhook_cert_dir {
            Certificates::files(dir)
        } else {
            for (flag, value) in [
                ("--webhook-service", &self.webhook_service),
                ("--webhook-namespace", &self.webhook_namespace),
                ("--webhook-configuration", &self.webhook_configuration),
            ] {
                if value.is_empty() {
                    return Err(Error::Config(format!("{flag} must not be empty")));
                }
            }
            let settings = SelfSigned {
                service: self.webhook_service.clone(),
                namespace: self.webhook_namespace.clone(),
                webhook_configurations: [
                    &self.webhook_configuration,
                    &self.webhook_claim_configuration,
                ]
                .into_iter()
                .filter(|name| !name.is_empty())
                .cloned()
                .collect(),
                validating_configurations: [&self.webhook_quota_configuration]
                    .into_iter()
                    .filter(|name| !name.is_empty())
                    .cloned()
                    .collect(),
                validity: self.webhook_cert_validity,
                renew_before: self.webhook_renew_before,
            };
            settings.validate()?;
            Certificates::SelfSigned(settings)
        };
        Ok(Some(WebhookConfig {
            address: self.webhook_address,
            driver_name: self.driver_name.clone(),
            field_manager: FIELD_MANAGER.to_owned(),
            certificates,
        }))
    }
}

impl Args {
    /// The default GpuClasses read from `--default-gpu-classes`; `None` when it is not set.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the flag, the file and, for a bad class, the document and
    /// field.
    pub fn default_classes(&self) -> Result<Option<DefaultClasses>> {
        self.default_gpu_classes
            .as_deref()
            .map(|path| DefaultClasses::load(path, &self.lease_namespace))
            .transpose()
    }
}

fn parse_address(value: &str) -> Result<Option<SocketAddr>> {
    kerf_ops::parse_listen_address("--metrics-address", value).map_err(Error::Config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory as _;

    fn parse(args: &[&str]) -> Args {
        Args::try_parse_from(std::iter::once("kerf-controller").chain(args.iter().copied()))
            .unwrap()
    }

    #[test]
    fn defaults_give_a_leader_elected_controller() {
        let config = parse(&[]).into_config(Some("host-1".to_owned())).unwrap();
        assert_eq!(config.controller.driver_name, "gpu.kerf.dev");
        assert_eq!(config.controller.field_manager, "kerf-controller");
        assert_eq!(config.controller.resync_period, Duration::from_secs(600));
        assert_eq!(config.controller.backoff, BackoffConfig::default());
        assert_eq!(config.controller.instance.as_deref(), Some("host-1"));
        let claims = config.controller.claims;
        assert_eq!(claims.assumed_pod_ttl, Duration::from_secs(300));
        assert_eq!(claims.max_node_rejections, 10);
        assert_eq!(claims.fragmentation_interval, Duration::from_secs(15));
        assert!(claims.idle_gpus_taint);
        assert_eq!(
            config.controller.node_pool_label,
            "node.kubernetes.io/instance-type"
        );
        let lease = config.leader_election.unwrap();
        assert_eq!(
            lease,
            LeaseConfig::new("kerf-controller", "kerf-system", "host-1")
        );
        assert_eq!(
            config.metrics_address,
            Some("0.0.0.0:8080".parse().unwrap())
        );
    }

    #[test]
    fn identity_flag_wins_over_the_host_name() {
        let config = parse(&["--identity", "pod-7"])
            .into_config(Some("host-1".to_owned()))
            .unwrap();
        assert_eq!(config.leader_election.unwrap().identity, "pod-7");
        let err = parse(&[]).into_config(None).unwrap_err();
        assert!(err.to_string().contains("--identity"), "{err}");
        let config = parse(&["--leader-elect", "false", "--metrics-address", ""])
            .into_config(None)
            .unwrap();
        assert_eq!(config.leader_election, None);
        assert_eq!(config.metrics_address, None);
    }

    #[test]
    fn bad_values_name_their_flag() {
        let cases: [(&[&str], &str); 5] = [
            (&["--driver-name", "Not_A_Domain"], "--driver-name"),
            (&["--metrics-address", "nowhere"], "--metrics-address"),
            (&["--lease-renew-deadline", "20s"], "--lease-renew-deadline"),
            (&["--backoff-base", "10m"], "--backoff-base"),
            (&["--resync-period", "0s"], "--resync-period"),
        ];
        for (args, flag) in cases {
            let err = parse(args).into_config(Some("h".to_owned())).unwrap_err();
            assert!(err.to_string().contains(flag), "{args:?}: {err}");
        }
    }

    #[test]
    fn webhook_flags_build_its_configuration() {
        let webhook = parse(&[]).webhook_config().unwrap().unwrap();
        assert_eq!(webhook.address, "0.0.0.0:9443".parse().unwrap());
        let Certificates::SelfSigned(settings) = webhook.certificates else {
            panic!("self-signed by default");
        };
        assert_eq!(settings.service, "kerf-webhook");
        assert_eq!(
            settings.webhook_configurations,
            ["kerf-scheduling-gate", "kerf-claim-parameters"]
        );
        let Certificates::SelfSigned(without) = parse(&["--webhook-claim-configuration", ""])
            .webhook_config()
            .unwrap()
            .unwrap()
            .certificates
        else {
            panic!("self-signed by default");
        };
        assert_eq!(without.webhook_configurations, ["kerf-scheduling-gate"]);
        assert_eq!(settings.validating_configurations, ["kerf-gpu-quota"]);
        assert!(settings.renew_before < settings.validity);
        let files = parse(&["--webhook-cert-dir", "/certs"])
            .webhook_config()
            .unwrap()
            .unwrap();
        assert_eq!(files.certificates, Certificates::files("/certs"));
        assert_eq!(
            parse(&["--webhook", "false"]).webhook_config().unwrap(),
            None
        );
        let err = parse(&["--webhook-renew-before", "48h"])
            .webhook_config()
            .unwrap_err();
        assert!(err.to_string().contains("--webhook-renew-before"), "{err}");
    }

    #[test]
    fn every_flag_has_an_environment_variable() {
        let command = Args::command();
        for arg in command.get_arguments() {
            let id = arg.get_id().as_str();
            if id == "help" || id == "version" {
                continue;
            }
            assert!(
                arg.get_env().is_some(),
                "--{id} has no environment variable"
            );
        }
        command.debug_assert();
    }
}
