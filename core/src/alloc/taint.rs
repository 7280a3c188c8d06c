//! Device taints and the tolerations of a request, matched as kube-scheduler matches them.
//!
//! Upstream (kubernetes/kubernetes):
//! - `staging/src/k8s.io/dynamic-resource-allocation/resourceclaim/devicetoleration.go`,
//!   `ToleratesTaint`: an empty toleration effect matches every effect, else the effects must
//!   be equal; an empty key matches every key (the API only allows it with `Exists`);
//!   `Exists` matches every value, `Equal` (or an empty operator) needs equal values.
//! - `staging/src/k8s.io/dynamic-resource-allocation/structured/internal/stable/allocator_stable.go`,
//!   `allocateDevice` / `taintPreventsAllocation`: only `NoSchedule` and `NoExecute` taints keep a
//!   device from a request that does not tolerate them; `None` (and any effect the allocator
//!   does not know) never does. The check applies to admin-access requests too.
//!
//! `tolerationSeconds` only delays eviction by a `NoExecute` taint of a device already
//! allocated; it plays no part in allocation and is not modelled here.

use std::fmt;

pub use crate::health::TaintEffect;

/// A taint published on a device (`spec.devices[].taints[]` of a ResourceSlice).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DeviceTaint {
    /// Taint key, e.g. `gpu.kerf.dev/unhealthy`.
    pub key: String,
    /// Taint value, e.g. `xid-79`; empty when the taint has none.
    pub value: String,
    /// What the taint does.
    pub effect: TaintEffect,
}

impl DeviceTaint {
    /// True when the taint keeps a device from requests that do not tolerate it.
    pub(crate) fn blocks_allocation(&self) -> bool {
        matches!(
            self.effect,
            TaintEffect::NoSchedule | TaintEffect::NoExecute
        )
    }
}

impl fmt::Display for DeviceTaint {
    /// `key=value:Effect`, as `kubectl describe` shows node taints (`key:Effect` without a
    /// value).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.key)?;
        if !self.value.is_empty() {
            write!(f, "={}", self.value)?;
        }
        let effect = self.effect.api_name().unwrap_or("None");
        write!(f, ":{effect}")
    }
}

/// How a toleration compares the taint's value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum TolerationOperator {
    /// The values must be equal (the API's default).
    #[default]
    Equal,
    /// Any value.
    Exists,
}

/// One toleration of a request (`exactly.tolerations[]` or `firstAvailable[].tolerations[]`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Toleration {
    /// Taint key to match; empty matches every key (with [`TolerationOperator::Exists`]).
    pub key: String,
    /// How the value is compared.
    pub operator: TolerationOperator,
    /// Value for [`TolerationOperator::Equal`].
    pub value: String,
    /// Effect to match; `None` matches every effect.
    pub effect: Option<TaintEffect>,
}

impl Toleration {
    /// True when this toleration tolerates `taint` (upstream `ToleratesTaint`).
    pub fn tolerates(&self, taint: &DeviceTaint) -> bool {
        if self.effect.is_some_and(|effect| effect != taint.effect) {
            return false;
        }
        if !self.key.is_empty() && self.key != taint.key {
            return false;
        }
        match self.operator {
            TolerationOperator::Equal => self.value == taint.value,
            TolerationOperator::Exists => true,
        }
    }
}

/// The first taint of `taints` that keeps the device from a request with `tolerations`, if any.
pub fn untolerated<'t>(
    taints: &'t [DeviceTaint],
    tolerations: &[Toleration],
) -> Option<&'t DeviceTaint> {
    taints
        .iter()
        .filter(|taint| taint.blocks_allocation())
        .find(|taint| !tolerations.iter().any(|t| t.tolerates(taint)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn taint(key: &str, value: &str, effect: TaintEffect) -> DeviceTaint {
        DeviceTaint {
            key: key.into(),
            value: value.into(),
            effect,
        }
    }

    #[test]
    fn display_follows_kubectl() {
        let t = taint("gpu.kerf.dev/unhealthy", "xid-79", TaintEffect::NoSchedule);
        assert_eq!(t.to_string(), "gpu.kerf.dev/unhealthy=xid-79:NoSchedule");
        let t = taint("k", "", TaintEffect::NoExecute);
        assert_eq!(t.to_string(), "k:NoExecute");
    }

    #[test]
    fn none_effect_never_blocks() {
        let taints = [taint("k", "v", TaintEffect::None)];
        assert!(untolerated(&taints, &[]).is_none());
    }

    #[test]
    fn equal_needs_equal_value_and_key() {
        let t = taint("k", "v", TaintEffect::NoSchedule);
        let equal = Toleration {
            key: "k".into(),
            value: "v".into(),
            ..Toleration::default()
        };
        assert!(equal.tolerates(&t));
        let other_value = Toleration {
            value: "w".into(),
            ..equal.clone()
        };
        assert!(!other_value.tolerates(&t));
        let other_key = Toleration {
            key: "j".into(),
            ..equal
        };
        assert!(!other_key.tolerates(&t));
    }

    #[test]
    fn empty_key_exists_tolerates_everything() {
        let all = Toleration {
            operator: TolerationOperator::Exists,
            ..Toleration::default()
        };
        assert!(all.tolerates(&taint("a", "b", TaintEffect::NoExecute)));
        assert!(all.tolerates(&taint("c", "", TaintEffect::NoSchedule)));
    }

    #[test]
    fn effect_must_match_when_set() {
        let no_schedule = Toleration {
            key: "k".into(),
            operator: TolerationOperator::Exists,
            effect: Some(TaintEffect::NoSchedule),
            ..Toleration::default()
        };
        assert!(no_schedule.tolerates(&taint("k", "x", TaintEffect::NoSchedule)));
        assert!(!no_schedule.tolerates(&taint("k", "x", TaintEffect::NoExecute)));
    }
}
