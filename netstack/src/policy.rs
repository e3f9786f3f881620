//! The egress policy of one sandbox: which destinations its connections may reach, and
//! where each destination the guest dials is reached on the host (`Policy::target`).
//!
//! Addresses as the guest sees them: the sandbox is 10.0.2.15/24, the gateway 10.0.2.2
//! stands for the host (its loopback, as in QEMU's user networking) and 10.0.2.3 is the
//! DNS server. Everything else is dialled as it is named.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::str::FromStr;

use ipnet::Ipv4Net;

use crate::{DNS, GATEWAY, SUBNET};

/// A rule that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("allow rule {rule:?}: {why} (write an IPv4 address or CIDR, optionally with :PORT, e.g. 10.1.2.3, 10.0.0.0/8, 0.0.0.0/0:443, 127.0.0.1:8080)")]
    BadRule { rule: String, why: String },
    #[error("host service {spec:?}: {why}")]
    BadHostService { spec: String, why: String },
}

/// One allow rule: an IPv4 network and, optionally, one port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rule {
    pub net: Ipv4Net,
    pub port: Option<u16>,
}

impl FromStr for Rule {
    type Err = PolicyError;

    fn from_str(s: &str) -> Result<Rule, PolicyError> {
        let bad = |why: &str| PolicyError::BadRule {
            rule: s.to_string(),
            why: why.to_string(),
        };
        let (addr, port) = match s.rsplit_once(':') {
            Some((a, p)) => {
                let port: u16 = p
                    .parse()
                    .map_err(|_| bad("the port is not a number from 1 to 65535"))?;
                if port == 0 {
                    return Err(bad("port 0 names no service"));
                }
                (a, Some(port))
            }
            None => (s, None),
        };
        let net = if addr.contains('/') {
            addr.parse::<Ipv4Net>()
                .map_err(|_| bad("not an IPv4 network"))?
                .trunc()
        } else {
            Ipv4Net::from(
                addr.parse::<Ipv4Addr>()
                    .map_err(|_| bad("not an IPv4 address"))?,
            )
        };
        Ok(Rule { net, port })
    }
}

impl std::fmt::Display for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let net = if self.net.prefix_len() == 32 {
            self.net.addr().to_string()
        } else {
            self.net.to_string()
        };
        match self.port {
            Some(p) => write!(f, "{net}:{p}"),
            None => f.write_str(&net),
        }
    }
}

impl Rule {
    fn allows(&self, dst: SocketAddrV4) -> bool {
        self.net.contains(dst.ip()) && self.port.is_none_or(|p| p == dst.port())
    }
}

/// A service of the host the sandbox reaches at `GATEWAY:port`, whatever the allow list
/// says: the trainer's model server, an interception proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostService {
    pub port: u16,
    pub target: SocketAddr,
}

impl FromStr for HostService {
    type Err = PolicyError;

    /// `PORT=ADDR:PORT` (the guest's port at the gateway, then the host's address), or
    /// `ADDR:PORT` for the same port.
    fn from_str(s: &str) -> Result<HostService, PolicyError> {
        let bad = |why: &str| PolicyError::BadHostService {
            spec: s.to_string(),
            why: why.to_string(),
        };
        let (port, target) = match s.split_once('=') {
            Some((p, t)) => (Some(p), t),
            None => (None, s),
        };
        let target: SocketAddr = target
            .parse()
            .map_err(|_| bad("the host side is not ADDR:PORT (e.g. 127.0.0.1:8000)"))?;
        let port = match port {
            Some(p) => p
                .parse()
                .map_err(|_| bad("the guest port is not a number"))?,
            None => target.port(),
        };
        if port == 0 || target.port() == 0 {
            return Err(bad("port 0 names no service"));
        }
        Ok(HostService { port, target })
    }
}

/// What a sandbox may reach.
#[derive(Clone, Debug, Default)]
pub struct Policy {
    pub allow: Vec<Rule>,
    pub host_services: Vec<HostService>,
}

impl Policy {
    /// Where a TCP or UDP flow the guest opened to `dst` goes on the host, or `None` when
    /// the policy does not allow it (the guest then gets a reset or a port unreachable).
    ///
    /// The gateway's ports are the host services first; any other port of the gateway is
    /// the host's loopback, reached only when an allow rule names 127.0.0.1 with it. The
    /// sandbox's own subnet holds nothing else to reach.
    pub fn target(&self, dst: SocketAddrV4) -> Option<SocketAddr> {
        if *dst.ip() == GATEWAY {
            if let Some(s) = self.host_services.iter().find(|s| s.port == dst.port()) {
                return Some(s.target);
            }
            let lo = SocketAddrV4::new(Ipv4Addr::LOCALHOST, dst.port());
            return self.allowed(lo).then_some(SocketAddr::V4(lo));
        }
        if *dst.ip() == DNS || SUBNET.contains(dst.ip()) || !dst.ip().is_unicast_addr() {
            return None;
        }
        self.allowed(dst).then_some(SocketAddr::V4(dst))
    }

    fn allowed(&self, dst: SocketAddrV4) -> bool {
        self.allow.iter().any(|r| r.allows(dst))
    }

    /// Whether the DNS server answers names of the world (an allow list exists) or only
    /// the gateway's own name (only host services: nothing else is reachable, so no name
    /// of the world is resolved, and no query leaves the host).
    pub fn resolves_world(&self) -> bool {
        !self.allow.is_empty()
    }
}

/// `Ipv4Addr::is_unicast` is unstable; what a flow may be addressed to.
trait Unicast {
    fn is_unicast_addr(&self) -> bool;
}

impl Unicast for Ipv4Addr {
    fn is_unicast_addr(&self) -> bool {
        !(self.is_broadcast() || self.is_multicast() || self.is_unspecified())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(s: &str) -> SocketAddrV4 {
        s.parse().unwrap()
    }

    #[test]
    fn rules_read_addresses_networks_and_ports() {
        let r: Rule = "10.1.0.0/16:5432".parse().unwrap();
        assert!(r.allows(v4("10.1.2.3:5432")));
        assert!(!r.allows(v4("10.1.2.3:5433")));
        assert!(!r.allows(v4("10.2.2.3:5432")));
        let r: Rule = "93.184.216.34".parse().unwrap();
        assert!(r.allows(v4("93.184.216.34:1")));
        assert_eq!(r.to_string(), "93.184.216.34");
        let r: Rule = "0.0.0.0/0:443".parse().unwrap();
        assert!(r.allows(v4("1.2.3.4:443")));
        assert_eq!(r.to_string(), "0.0.0.0/0:443");
        // A network written with host bits keeps only its network part.
        let r: Rule = "10.1.2.3/8".parse().unwrap();
        assert_eq!(r.to_string(), "10.0.0.0/8");
    }

    #[test]
    fn bad_rules_say_what_is_wrong() {
        for (bad, why) in [
            ("", "not an IPv4 address"),
            ("example.com", "not an IPv4 address"),
            ("10.0.0.0/33", "not an IPv4 network"),
            ("1.2.3.4:0", "port 0"),
            ("1.2.3.4:99999", "the port is not a number"),
            ("::1", "not an IPv4 address"),
        ] {
            let e = bad.parse::<Rule>().unwrap_err().to_string();
            assert!(e.contains(why), "{bad:?}: {e}");
            assert!(e.contains("0.0.0.0/0:443"), "{e}");
        }
    }

    #[test]
    fn host_services_name_a_guest_port_and_a_host_address() {
        let s: HostService = "8000=127.0.0.1:9000".parse().unwrap();
        assert_eq!(
            (s.port, s.target),
            (8000, "127.0.0.1:9000".parse().unwrap())
        );
        let s: HostService = "[::1]:9000".parse().unwrap();
        assert_eq!(s.port, 9000);
        for bad in ["8000", "x=127.0.0.1:1", "1=127.0.0.1:0", "127.0.0.1"] {
            assert!(bad.parse::<HostService>().is_err(), "{bad}");
        }
    }

    #[test]
    fn the_gateway_is_the_hosts_loopback_only_where_allowed() {
        let p = Policy {
            allow: vec![
                "127.0.0.1:8080".parse().unwrap(),
                "192.0.2.0/24".parse().unwrap(),
            ],
            host_services: vec!["80=127.0.0.1:9000".parse().unwrap()],
        };
        assert_eq!(
            p.target(v4("10.0.2.2:80")),
            Some("127.0.0.1:9000".parse().unwrap())
        );
        assert_eq!(
            p.target(v4("10.0.2.2:8080")),
            Some("127.0.0.1:8080".parse().unwrap())
        );
        assert_eq!(p.target(v4("10.0.2.2:8081")), None);
        assert_eq!(
            p.target(v4("192.0.2.9:1")),
            Some("192.0.2.9:1".parse().unwrap())
        );
        assert_eq!(p.target(v4("198.51.100.1:80")), None);
        // The DNS server's other ports, the sandbox's subnet, broadcast: nothing.
        assert_eq!(p.target(v4("10.0.2.3:80")), None);
        assert_eq!(p.target(v4("10.0.2.99:80")), None);
        assert_eq!(p.target(v4("255.255.255.255:80")), None);
        assert!(p.resolves_world());
        assert!(!Policy::default().resolves_world());
        assert_eq!(Policy::default().target(v4("1.1.1.1:443")), None);
    }
}
