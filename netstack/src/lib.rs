//! `amber-netstack`: a sandbox's network, in user mode on the host. QEMU's `stream`
//! netdev carries the guest's Ethernet frames over a Unix socket to a TCP/IP stack
//! (smoltcp) in the node daemon; the stack terminates every connection the guest opens
//! and, when the sandbox's `Policy` allows its destination, splices it to a socket the
//! host opens. Nothing on the host's own network changes and nothing needs root.
//!
//! What the guest sees (as in QEMU's user networking): it is `GUEST` in 10.0.2.0/24,
//! its gateway `GATEWAY` stands for the host, `DNS` answers names (`HOST_NAME` is the
//! gateway), and what is not allowed fails at once (a reset or a port unreachable).
//! Host services are ports of the gateway; published ports are listeners on the host
//! that open connections to the guest.
//!
//! Modules: `policy` (allow rules, host services, where a flow goes), `dns` (the DNS
//! server's answers), `stack` (the event loop: frames, sockets, splicing).

pub mod policy;

mod dns;
mod stack;

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ipnet::Ipv4Net;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

pub use policy::{HostService, Policy, PolicyError, Rule};

/// The sandbox's own address.
pub const GUEST: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 15);
/// The gateway: the host, as the sandbox reaches it.
pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 2);
/// The sandbox's DNS server.
pub const DNS: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 3);
pub const PREFIX_LEN: u8 = 24;
/// The sandbox's network.
pub const SUBNET: Ipv4Net = Ipv4Net::new_assert(Ipv4Addr::new(10, 0, 2, 0), PREFIX_LEN);
/// The guest's MAC (QEMU's `virtio-net-device,mac=`).
pub const GUEST_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];
/// The gateway's MAC.
pub const GATEWAY_MAC: [u8; 6] = [0x52, 0x55, 0x0a, 0x00, 0x02, 0x02];
/// The name of the gateway in the sandbox's DNS and /etc/hosts.
pub const HOST_NAME: &str = "host.amber.internal";

/// Why a sandbox's network could not start.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("listening for QEMU's network link on {path}: {source}")]
    Link {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("publishing guest port {guest_port} on {host}: {source}")]
    Publish {
        guest_port: u16,
        host: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// A guest port reachable from the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Published {
    pub guest_port: u16,
    /// Where the host reaches it (the port chosen when 0 was asked for).
    pub host: SocketAddr,
}

/// One sandbox's running network. Dropping it stops everything it runs.
pub struct Netstack {
    pub published: Vec<Published>,
    /// Held, never read: dropping it aborts the stack's tasks.
    _tasks: JoinSet<()>,
}

impl Netstack {
    /// Listens at `link` for QEMU's `-netdev stream,addr.type=unix,addr.path=LINK` (which
    /// may connect again after a restore) and on each `publish` (guest port, host
    /// address) for the host's clients, and runs the sandbox's network under `policy`.
    pub async fn start(
        link: &Path,
        policy: Policy,
        publish: &[(u16, SocketAddr)],
    ) -> Result<Netstack, NetError> {
        let _ = std::fs::remove_file(link);
        let qemu = UnixListener::bind(link).map_err(|source| NetError::Link {
            path: link.to_path_buf(),
            source,
        })?;
        let mut listeners = Vec::new();
        let mut published = Vec::new();
        for &(guest_port, host) in publish {
            let l = TcpListener::bind(host)
                .await
                .map_err(|source| NetError::Publish {
                    guest_port,
                    host,
                    source,
                })?;
            let host = l.local_addr().map_err(|source| NetError::Publish {
                guest_port,
                host,
                source,
            })?;
            published.push(Published { guest_port, host });
            listeners.push((guest_port, l));
        }
        let (events, rx) = mpsc::channel(1024);
        let mut tasks = JoinSet::new();
        tasks.spawn(stack::Stack::new(Arc::new(policy), events.clone()).run(rx));
        tasks.spawn(stack::serve_qemu(qemu, events.clone()));
        for (guest_port, l) in listeners {
            let events = events.clone();
            tasks.spawn(async move {
                while let Ok((stream, _)) = l.accept().await {
                    let _ = stream.set_nodelay(true);
                    if events
                        .send(stack::Event::Inbound { guest_port, stream })
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
        Ok(Netstack {
            published,
            _tasks: tasks,
        })
    }
}
