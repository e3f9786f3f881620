//! A sandbox's network on the node: the API's `NetworkSpec` read into the netstack's
//! policy and published ports (bad input is the user's error, said before anything
//! starts), the guest's interface settings for `Boot`, and what `SandboxInfo` shows.

use std::net::{Ipv4Addr, SocketAddr};

use amber_api::node::{NetworkInfo, NetworkSpec, PublishedPort};
use amber_netstack::{
    HostService, Policy, Rule, DNS, GATEWAY, GUEST, GUEST_MAC, HOST_NAME, PREFIX_LEN,
};

/// Most entries of each list a sandbox may have.
const MAX_ENTRIES: usize = 256;

/// A network spec that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    #[error(transparent)]
    Policy(#[from] amber_netstack::PolicyError),
    #[error("port {spec:?}: {why} (write GUEST_PORT, or GUEST_PORT=ADDR:PORT for a host address; port 0 there picks a free one)")]
    BadPort { spec: String, why: &'static str },
    #[error("network.{list} has {n} entries; at most {MAX_ENTRIES}")]
    TooMany { list: &'static str, n: usize },
    #[error("guest port {0} is published twice")]
    DuplicatePort(u16),
}

/// A spec read: what the netstack runs.
#[derive(Clone, Debug)]
pub struct Network {
    pub policy: Policy,
    /// (guest port, host address to listen on).
    pub publish: Vec<(u16, SocketAddr)>,
}

impl Network {
    pub fn parse(spec: &NetworkSpec) -> Result<Network, NetworkError> {
        for (list, n) in [
            ("allow", spec.allow.len()),
            ("host_services", spec.host_services.len()),
            ("ports", spec.ports.len()),
        ] {
            if n > MAX_ENTRIES {
                return Err(NetworkError::TooMany { list, n });
            }
        }
        let allow = spec
            .allow
            .iter()
            .map(|r| r.parse::<Rule>())
            .collect::<Result<_, _>>()?;
        let host_services = spec
            .host_services
            .iter()
            .map(|s| s.parse::<HostService>())
            .collect::<Result<_, _>>()?;
        let mut publish: Vec<(u16, SocketAddr)> = Vec::new();
        for p in &spec.ports {
            let entry = published(p)?;
            if publish.iter().any(|(g, _)| *g == entry.0) {
                return Err(NetworkError::DuplicatePort(entry.0));
            }
            publish.push(entry);
        }
        Ok(Network {
            policy: Policy {
                allow,
                host_services,
            },
            publish,
        })
    }
}

/// `PORT` or `PORT=ADDR:PORT`.
fn published(spec: &str) -> Result<(u16, SocketAddr), NetworkError> {
    let bad = |why| NetworkError::BadPort {
        spec: spec.to_string(),
        why,
    };
    let (guest, host) = match spec.split_once('=') {
        Some((g, h)) => (
            g,
            h.parse::<SocketAddr>()
                .map_err(|_| bad("the host side is not ADDR:PORT"))?,
        ),
        None => (spec, SocketAddr::from((Ipv4Addr::LOCALHOST, 0))),
    };
    let guest: u16 = guest
        .parse()
        .map_err(|_| bad("the guest port is not a number from 1 to 65535"))?;
    if guest == 0 {
        return Err(bad("guest port 0 names no service"));
    }
    // A sandbox's port on the node's own network would be open to whoever reaches the
    // node, past the API's tokens.
    if !host.ip().is_loopback() {
        return Err(bad(
            "only loopback addresses of the node publish a sandbox's port",
        ));
    }
    Ok((guest, host))
}

/// The guest's MAC as QEMU and the agent write it.
fn guest_mac() -> String {
    GUEST_MAC.map(|b| format!("{b:02x}")).join(":")
}

/// How the guest agent sets up its interface.
pub fn guest() -> amber_guest::Network {
    amber_guest::Network {
        mac: guest_mac(),
        address: GUEST,
        prefix_len: PREFIX_LEN,
        gateway: GATEWAY,
        nameserver: DNS,
        hosts: vec![(GATEWAY.to_string(), HOST_NAME.to_string())],
    }
}

/// QEMU's arguments for the interface whose frames go to the netstack at `link`.
pub fn qemu_args(link: &std::path::Path) -> [String; 4] {
    let mac = guest_mac();
    [
        "-netdev".into(),
        format!(
            "stream,id=net0,server=off,addr.type=unix,addr.path={}",
            link.display()
        ),
        "-device".into(),
        format!("virtio-net-device,netdev=net0,mac={mac}"),
    ]
}

/// What `SandboxInfo` shows of a running network.
pub fn info(spec: &NetworkSpec, published: &[amber_netstack::Published]) -> NetworkInfo {
    NetworkInfo {
        address: GUEST.to_string(),
        gateway: GATEWAY.to_string(),
        dns: DNS.to_string(),
        allow: spec.allow.clone(),
        host_services: spec.host_services.clone(),
        ports: published
            .iter()
            .map(|p| PublishedPort {
                guest_port: p.guest_port,
                host: p.host.to_string(),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(allow: &[&str], services: &[&str], ports: &[&str]) -> NetworkSpec {
        let v = |a: &[&str]| a.iter().map(|s| s.to_string()).collect();
        NetworkSpec {
            allow: v(allow),
            host_services: v(services),
            ports: v(ports),
        }
    }

    #[test]
    fn a_spec_reads_into_a_policy_and_ports() {
        let n = Network::parse(&spec(
            &["10.0.0.0/8:443"],
            &["8000=127.0.0.1:9000"],
            &["80", "8080=127.0.0.1:18080"],
        ))
        .unwrap();
        assert_eq!(n.policy.allow.len(), 1);
        assert_eq!(n.policy.host_services[0].port, 8000);
        assert_eq!(
            n.publish,
            vec![
                (80, "127.0.0.1:0".parse().unwrap()),
                (8080, "127.0.0.1:18080".parse().unwrap())
            ]
        );
        assert_eq!(guest().mac, "52:54:00:12:34:56");
    }

    #[test]
    fn bad_specs_say_which_entry_and_why() {
        for (s, why) in [
            (spec(&["nowhere"], &[], &[]), "allow rule \"nowhere\""),
            (spec(&[], &["8000"], &[]), "host service \"8000\""),
            (
                spec(&[], &[], &["x"]),
                "port \"x\": the guest port is not a number",
            ),
            (spec(&[], &[], &["0"]), "guest port 0"),
            (
                spec(&[], &[], &["80=localhost"]),
                "the host side is not ADDR:PORT",
            ),
            (spec(&[], &[], &["80", "80=127.0.0.1:1"]), "published twice"),
            (
                spec(&[], &[], &["80=0.0.0.0:8080"]),
                "only loopback addresses",
            ),
        ] {
            let e = Network::parse(&s).unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        }
        let many = spec(&vec!["1.2.3.4"; 300], &[], &[]);
        assert!(Network::parse(&many)
            .unwrap_err()
            .to_string()
            .contains("at most 256"));
    }
}
