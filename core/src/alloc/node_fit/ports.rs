//! Host ports: which the pods on a node hold, and whether a pod's ports conflict with them.
//!
//! Upstream: kubernetes/kubernetes `pkg/scheduler/framework/plugins/nodeports/node_ports.go`
//! (`Filter` → `fitsPorts`: any wanted port that conflicts fails the node, reason
//! [`NODE_PORTS_REASON`](super::NODE_PORTS_REASON)), the ports it checks
//! (`pkg/scheduler/util/utils.go` `GetHostPorts`: the `hostPort` > 0 ports of the app
//! containers and of the restartable init containers, left to the caller), and the node's
//! used ports (`pkg/scheduler/framework/types.go` `HostPortInfo`: `sanitize` makes an empty IP
//! `0.0.0.0` and an empty protocol `TCP`; `CheckConflict`: a wanted port on `0.0.0.0`
//! conflicts with the same protocol and port on any IP, one on another IP with that IP's and
//! `0.0.0.0`'s).
//!
//! Upstream keeps a set and removes a pod's ports when the pod goes; here each port counts its
//! holders, so removing one of two pods that hold the same port (possible for pods created with
//! `spec.nodeName`, which no scheduler checked) leaves it held.

use std::collections::BTreeMap;

/// Upstream `DefaultBindAllHostIP`.
const BIND_ALL: &str = "0.0.0.0";

/// One host port: IP, protocol and port number, sanitized as upstream does.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HostPort {
    /// The host IP (`0.0.0.0` for all).
    pub ip: String,
    /// `TCP`, `UDP` or `SCTP`.
    pub protocol: String,
    /// The port number (> 0).
    pub port: i32,
}

impl HostPort {
    /// A host port with upstream's defaults filled in (empty IP: all; empty protocol: TCP).
    pub fn new(ip: &str, protocol: &str, port: i32) -> Self {
        HostPort {
            ip: if ip.is_empty() { BIND_ALL } else { ip }.to_owned(),
            protocol: if protocol.is_empty() { "TCP" } else { protocol }.to_owned(),
            port,
        }
    }
}

/// The host ports held on a node, each with how many pods hold it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostPorts {
    /// `ip` → (`protocol`, `port`) → holders.
    by_ip: BTreeMap<String, BTreeMap<(String, i32), u32>>,
}

impl HostPorts {
    /// True when no port is held.
    pub fn is_empty(&self) -> bool {
        self.by_ip.is_empty()
    }

    /// Counts the ports of one pod (ports ≤ 0 are ignored, as upstream's `Add` does).
    pub fn add(&mut self, ports: &[HostPort]) {
        for p in ports.iter().filter(|p| p.port > 0) {
            let holders = self
                .by_ip
                .entry(p.ip.clone())
                .or_default()
                .entry((p.protocol.clone(), p.port))
                .or_insert(0);
            *holders = holders.saturating_add(1);
        }
    }

    /// Removes the ports of a pod counted by [`HostPorts::add`].
    pub fn remove(&mut self, ports: &[HostPort]) {
        for p in ports.iter().filter(|p| p.port > 0) {
            let Some(on_ip) = self.by_ip.get_mut(&p.ip) else {
                continue;
            };
            let key = (p.protocol.clone(), p.port);
            if let Some(holders) = on_ip.get_mut(&key) {
                *holders = holders.saturating_sub(1);
                if *holders == 0 {
                    on_ip.remove(&key);
                }
            }
            if on_ip.is_empty() {
                self.by_ip.remove(&p.ip);
            }
        }
    }

    /// How many pods hold `port` in a way that conflicts with it (upstream `CheckConflict`,
    /// counted): 0 when it is free.
    pub fn conflicts(&self, port: &HostPort) -> u32 {
        if port.port <= 0 {
            return 0;
        }
        let key = (port.protocol.clone(), port.port);
        let held = |ip: &str| {
            self.by_ip
                .get(ip)
                .and_then(|ports| ports.get(&key))
                .copied()
                .unwrap_or(0)
        };
        if port.ip == BIND_ALL {
            return self
                .by_ip
                .values()
                .filter_map(|ports| ports.get(&key))
                .sum();
        }
        held(BIND_ALL).saturating_add(held(&port.ip))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_ip_and_protocol_mean_all_ips_and_tcp() {
        assert_eq!(
            HostPort::new("", "", 80),
            HostPort::new("0.0.0.0", "TCP", 80)
        );
    }

    /// Upstream `TestHostPortInfo_Check`'s cases, by their meaning.
    #[test]
    fn conflicts_follow_ip_protocol_and_port() {
        let mut held = HostPorts::default();
        held.add(&[HostPort::new("127.0.0.1", "TCP", 80)]);
        assert_eq!(held.conflicts(&HostPort::new("127.0.0.1", "TCP", 80)), 1);
        assert_eq!(held.conflicts(&HostPort::new("127.0.0.1", "UDP", 80)), 0);
        assert_eq!(held.conflicts(&HostPort::new("127.0.0.1", "TCP", 81)), 0);
        assert_eq!(held.conflicts(&HostPort::new("127.0.0.2", "TCP", 80)), 0);
        assert_eq!(held.conflicts(&HostPort::new("", "", 80)), 1, "all IPs");
        let mut all = HostPorts::default();
        all.add(&[HostPort::new("", "TCP", 80)]);
        assert_eq!(all.conflicts(&HostPort::new("10.0.0.1", "TCP", 80)), 1);
        assert_eq!(all.conflicts(&HostPort::new("10.0.0.1", "TCP", 0)), 0);
    }

    #[test]
    fn a_port_two_pods_hold_stays_held_until_both_go() {
        let mut held = HostPorts::default();
        let port = [HostPort::new("", "TCP", 8080)];
        held.add(&port);
        held.add(&port);
        held.remove(&port);
        assert_eq!(held.conflicts(&port[0]), 1);
        held.remove(&port);
        assert!(held.is_empty());
    }
}
