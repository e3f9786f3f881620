//! The event loop of one sandbox's network: Ethernet frames from QEMU's `stream` netdev
//! go through a smoltcp interface that answers for every address the policy lets the
//! guest reach (AnyIP), and each TCP connection or UDP flow the guest opens is spliced to
//! a socket the host opens to the flow's target.
//!
//! Invariants kept here:
//! - A guest TCP handshake completes only once the host's connection to the target is up:
//!   the SYN waits in `pending_syn` meanwhile, so a refused or unreachable target is a
//!   reset in the guest (`ECONNREFUSED`), never a connection that opens and then drops.
//! - A flow the policy does not allow reaches no socket: smoltcp answers it with a reset
//!   (TCP) or a port unreachable (UDP), so it fails at once instead of hanging.
//! - Memory per connection is bounded: one read of at most `CHUNK` bytes from the host
//!   waits for room in the guest socket before the next read, and guest data is taken
//!   from the socket only when the host writer has room (otherwise the guest's window
//!   closes).
//! - ARP and ping are answered only for the gateway and the DNS server: AnyIP would
//!   otherwise make every address look present.

use std::collections::{HashMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::phy::{Device, DeviceCapabilities, Medium, RxToken, TxToken};
use smoltcp::socket::{tcp, udp};
use smoltcp::time::Instant;
use smoltcp::wire::{
    ArpOperation, ArpPacket, EthernetAddress, EthernetFrame, EthernetProtocol, HardwareAddress,
    Icmpv4Message, Icmpv4Packet, IpAddress, IpCidr, IpListenEndpoint, IpProtocol, Ipv4Packet,
    TcpPacket, UdpPacket,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket, UnixListener};
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinHandle;

use crate::dns::{self, Plan};
use crate::{Policy, DNS, GATEWAY, GATEWAY_MAC, GUEST, PREFIX_LEN};

/// Bytes moved per read or write of a spliced connection.
const CHUNK: usize = 64 * 1024;
/// Buffers of each guest TCP socket (window scaling lets the guest use all of it).
const TCP_BUFFER: usize = 256 * 1024;
/// A host connection that does not open in this long is a reset in the guest.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// A UDP flow without a datagram either way for this long is forgotten.
const UDP_IDLE: Duration = Duration::from_secs(120);
/// DNS questions being resolved at once; more are dropped (the guest asks again).
const DNS_IN_FLIGHT: usize = 64;
/// Ethernet frames larger than this are not frames of a 1500-byte MTU link.
const MAX_FRAME: usize = 1514 + 4;

/// A guest flow: its source port and the destination it dialled.
type Flow = (u16, SocketAddrV4);

pub(crate) enum Event {
    /// QEMU (re)connected: frames for the guest go to this writer from now on.
    Qemu(mpsc::Sender<Vec<u8>>),
    Frame(Vec<u8>),
    Connected {
        flow: Flow,
        result: std::io::Result<TcpStream>,
    },
    HostData(u64, Bytes),
    HostEof(u64),
    HostError(u64),
    Written,
    Inbound {
        guest_port: u16,
        stream: TcpStream,
    },
    DnsAnswer {
        to: smoltcp::wire::IpEndpoint,
        reply: Vec<u8>,
    },
    UdpReply {
        flow: Flow,
        data: Vec<u8>,
    },
}

/// The frames between smoltcp and QEMU.
#[derive(Default)]
struct Frames {
    rx: VecDeque<Vec<u8>>,
    tx: Vec<Vec<u8>>,
}

struct Rx(Vec<u8>);
struct Tx<'a>(&'a mut Vec<Vec<u8>>);

impl RxToken for Rx {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        f(&self.0)
    }
}

impl TxToken for Tx<'_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        let mut b = vec![0; len];
        let r = f(&mut b);
        self.0.push(b);
        r
    }
}

impl Device for Frames {
    type RxToken<'a> = Rx;
    type TxToken<'a> = Tx<'a>;

    fn receive(&mut self, _: Instant) -> Option<(Rx, Tx<'_>)> {
        let f = self.rx.pop_front()?;
        Some((Rx(f), Tx(&mut self.tx)))
    }

    fn transmit(&mut self, _: Instant) -> Option<Tx<'_>> {
        Some(Tx(&mut self.tx))
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut c = DeviceCapabilities::default();
        c.medium = Medium::Ethernet;
        c.max_transmission_unit = 1514;
        c
    }
}

/// One spliced TCP connection.
struct Conn {
    handle: SocketHandle,
    /// Guest bytes for the host; `None` once the guest's FIN was passed on.
    to_host: Option<mpsc::Sender<Bytes>>,
    /// Host bytes not yet in the guest socket.
    pending: Bytes,
    /// Lets the host reader read again.
    more: Arc<Notify>,
    host_eof: bool,
    fin_sent: bool,
    /// Seen closed once: removed at the next look, after smoltcp sent what closing needs.
    closing: bool,
    reader: JoinHandle<()>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

struct UdpFlow {
    host: Arc<UdpSocket>,
    last: std::time::Instant,
    reader: JoinHandle<()>,
}

impl Drop for UdpFlow {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

pub(crate) struct Stack {
    iface: Interface,
    dev: Frames,
    sockets: SocketSet<'static>,
    policy: Arc<Policy>,
    events: mpsc::Sender<Event>,
    qemu: Option<mpsc::Sender<Vec<u8>>>,
    conns: HashMap<u64, Conn>,
    next_id: u64,
    pending_syn: HashMap<Flow, Vec<u8>>,
    dns: SocketHandle,
    dns_in_flight: Arc<tokio::sync::Semaphore>,
    udp_bound: HashMap<SocketAddrV4, SocketHandle>,
    udp_flows: HashMap<Flow, UdpFlow>,
    next_port: u16,
}

impl Stack {
    pub(crate) fn new(policy: Arc<Policy>, events: mpsc::Sender<Event>) -> Stack {
        let mut dev = Frames::default();
        let mut config = Config::new(HardwareAddress::Ethernet(EthernetAddress(GATEWAY_MAC)));
        // Initial sequence numbers differ from stack to stack.
        config.random_seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(std::process::id()) << 32;
        let mut iface = Interface::new(config, &mut dev, Instant::now());
        iface.update_ip_addrs(|a| {
            a.push(IpCidr::new(IpAddress::Ipv4(GATEWAY), PREFIX_LEN))
                .expect("room for the gateway");
            a.push(IpCidr::new(IpAddress::Ipv4(DNS), PREFIX_LEN))
                .expect("room for the DNS server");
        });
        // AnyIP: packets to any address routed through the gateway are ours to answer.
        iface.set_any_ip(true);
        iface
            .routes_mut()
            .add_default_ipv4_route(GATEWAY)
            .expect("room for the default route");
        let mut sockets = SocketSet::new(Vec::new());
        let mut dns = udp::Socket::new(
            udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 64], vec![0; 64 * 1024]),
            udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 64], vec![0; 64 * 1024]),
        );
        dns.bind(IpListenEndpoint {
            addr: Some(IpAddress::Ipv4(DNS)),
            port: 53,
        })
        .expect("binding the DNS socket");
        let dns = sockets.add(dns);
        Stack {
            iface,
            dev,
            sockets,
            policy,
            events,
            qemu: None,
            conns: HashMap::new(),
            next_id: 0,
            pending_syn: HashMap::new(),
            dns,
            dns_in_flight: Arc::new(tokio::sync::Semaphore::new(DNS_IN_FLIGHT)),
            udp_bound: HashMap::new(),
            udp_flows: HashMap::new(),
            next_port: 49152,
        }
    }

    /// Runs until the event channel closes (the `Netstack` was dropped).
    pub(crate) async fn run(mut self, mut rx: mpsc::Receiver<Event>) {
        let mut last_sweep = std::time::Instant::now();
        loop {
            self.poll();
            let now = Instant::now();
            let delay = self
                .iface
                .poll_delay(now, &self.sockets)
                .map_or(Duration::from_secs(5), |d| {
                    Duration::from_micros(d.total_micros())
                });
            tokio::select! {
                ev = rx.recv() => match ev {
                    Some(ev) => {
                        self.handle(ev);
                        // Take what else is waiting before polling again.
                        while let Ok(ev) = rx.try_recv() {
                            self.handle(ev);
                        }
                    }
                    None => return,
                },
                _ = tokio::time::sleep(delay) => {}
            }
            if last_sweep.elapsed() > Duration::from_secs(5) {
                last_sweep = std::time::Instant::now();
                self.sweep_udp();
            }
        }
    }

    /// Lets smoltcp process what came in, moves data between sockets and hosts, and
    /// sends what smoltcp produced to QEMU.
    fn poll(&mut self) {
        self.iface
            .poll(Instant::now(), &mut self.dev, &mut self.sockets);
        self.service_tcp();
        self.service_dns();
        self.service_udp();
        self.iface
            .poll(Instant::now(), &mut self.dev, &mut self.sockets);
        for f in self.dev.tx.drain(..) {
            if let Some(q) = &self.qemu {
                // A full queue drops the frame, as a busy link does; TCP sends it again.
                let _ = q.try_send(f);
            }
        }
    }

    fn handle(&mut self, ev: Event) {
        match ev {
            Event::Qemu(tx) => self.qemu = Some(tx),
            Event::Frame(f) => self.ingress(f),
            Event::Connected { flow, result } => {
                let Some(syn) = self.pending_syn.remove(&flow) else {
                    return;
                };
                if let Ok(stream) = result {
                    let mut s = tcp_socket();
                    let listen = IpListenEndpoint {
                        addr: Some(IpAddress::Ipv4(*flow.1.ip())),
                        port: flow.1.port(),
                    };
                    if s.listen(listen).is_ok() {
                        let handle = self.sockets.add(s);
                        self.add_conn(handle, stream);
                    }
                }
                // With no listening socket (the host's connection failed) smoltcp
                // answers the SYN with a reset.
                self.dev.rx.push_back(syn);
            }
            Event::HostData(id, data) => {
                if let Some(c) = self.conns.get_mut(&id) {
                    c.pending = data;
                }
            }
            Event::HostEof(id) => {
                if let Some(c) = self.conns.get_mut(&id) {
                    c.host_eof = true;
                }
            }
            Event::HostError(id) => {
                if let Some(c) = self.conns.get(&id) {
                    self.sockets.get_mut::<tcp::Socket>(c.handle).abort();
                }
            }
            Event::Written => {}
            Event::Inbound { guest_port, stream } => self.inbound(guest_port, stream),
            Event::DnsAnswer { to, reply } => {
                let _ = self
                    .sockets
                    .get_mut::<udp::Socket>(self.dns)
                    .send_slice(&reply, to);
            }
            Event::UdpReply { flow, data } => {
                if let Some(h) = self.udp_bound.get(&flow.1) {
                    if let Some(f) = self.udp_flows.get_mut(&flow) {
                        f.last = std::time::Instant::now();
                    }
                    let to = smoltcp::wire::IpEndpoint::new(IpAddress::Ipv4(GUEST), flow.0);
                    let _ = self
                        .sockets
                        .get_mut::<udp::Socket>(*h)
                        .send_slice(&data, to);
                }
            }
        }
    }

    /// One frame from the guest: flows are set up before smoltcp sees their first packet.
    fn ingress(&mut self, f: Vec<u8>) {
        match inspect(&f) {
            Some(Seen::Syn(flow)) => {
                if self.pending_syn.contains_key(&flow) {
                    return; // the guest sent its SYN again while the host connects
                }
                if self.has_tcp(flow) {
                    self.dev.rx.push_back(f);
                    return;
                }
                let Some(target) = self.policy.target(flow.1) else {
                    self.dev.rx.push_back(f); // reset: not allowed
                    return;
                };
                self.pending_syn.insert(flow, f);
                let events = self.events.clone();
                tokio::spawn(async move {
                    let result =
                        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(target))
                            .await
                        {
                            Ok(r) => r,
                            Err(_) => Err(std::io::ErrorKind::TimedOut.into()),
                        };
                    let _ = events.send(Event::Connected { flow, result }).await;
                });
            }
            Some(Seen::Udp(flow)) => {
                if *flow.1.ip() != DNS {
                    if let Some(target) = self.policy.target(flow.1) {
                        self.open_udp(flow, target);
                    }
                }
                self.dev.rx.push_back(f);
            }
            Some(Seen::NotOurs) => {}
            None => self.dev.rx.push_back(f),
        }
    }

    /// Whether a socket already carries `flow` (a SYN for it is a retransmission).
    fn has_tcp(&self, flow: Flow) -> bool {
        self.conns.values().any(|c| {
            let s = self.sockets.get::<tcp::Socket>(c.handle);
            matches!(
                (s.remote_endpoint(), s.local_endpoint()),
                (Some(r), Some(l)) if r.port == flow.0 && l.port == flow.1.port()
                    && l.addr == IpAddress::Ipv4(*flow.1.ip())
            ) && !matches!(s.state(), tcp::State::Closed | tcp::State::TimeWait)
        })
    }

    fn add_conn(&mut self, handle: SocketHandle, stream: TcpStream) {
        let id = self.next_id;
        self.next_id += 1;
        let _ = stream.set_nodelay(true);
        let (mut rd, mut wr) = stream.into_split();
        let more = Arc::new(Notify::new());
        let events = self.events.clone();
        let more2 = more.clone();
        let reader = tokio::spawn(async move {
            let mut buf = vec![0u8; CHUNK];
            loop {
                let ev = match rd.read(&mut buf).await {
                    Ok(0) => Event::HostEof(id),
                    Ok(n) => Event::HostData(id, Bytes::copy_from_slice(&buf[..n])),
                    Err(_) => Event::HostError(id),
                };
                let last = !matches!(ev, Event::HostData(..));
                if events.send(ev).await.is_err() || last {
                    return;
                }
                more2.notified().await;
            }
        });
        let (to_host, mut from_guest) = mpsc::channel::<Bytes>(4);
        let events = self.events.clone();
        tokio::spawn(async move {
            while let Some(b) = from_guest.recv().await {
                if wr.write_all(&b).await.is_err() {
                    let _ = events.send(Event::HostError(id)).await;
                    return;
                }
                let _ = events.send(Event::Written).await;
            }
            let _ = wr.shutdown().await;
        });
        self.conns.insert(
            id,
            Conn {
                handle,
                to_host: Some(to_host),
                pending: Bytes::new(),
                more,
                host_eof: false,
                fin_sent: false,
                closing: false,
                reader,
            },
        );
    }

    /// A connection to a published port: the host's client is spliced to a connection
    /// the gateway opens to the guest's port.
    fn inbound(&mut self, guest_port: u16, stream: TcpStream) {
        let mut s = tcp_socket();
        let local = self.ephemeral_port();
        let remote = (IpAddress::Ipv4(GUEST), guest_port);
        if s.connect(
            self.iface.context(),
            remote,
            (IpAddress::Ipv4(GATEWAY), local),
        )
        .is_ok()
        {
            let handle = self.sockets.add(s);
            self.add_conn(handle, stream);
        }
    }

    fn ephemeral_port(&mut self) -> u16 {
        let p = self.next_port;
        self.next_port = if p == u16::MAX { 49152 } else { p + 1 };
        p
    }

    fn service_tcp(&mut self) {
        let mut gone = Vec::new();
        for (id, c) in self.conns.iter_mut() {
            let s = self.sockets.get_mut::<tcp::Socket>(c.handle);
            // Host -> guest.
            if !c.pending.is_empty() && s.can_send() {
                if let Ok(n) = s.send_slice(&c.pending) {
                    let _ = c.pending.split_to(n);
                    if c.pending.is_empty() {
                        c.more.notify_one();
                    }
                }
            }
            if c.host_eof && c.pending.is_empty() && !c.fin_sent && s.may_send() {
                s.close();
                c.fin_sent = true;
            }
            // Guest -> host, as far as the writer has room.
            if let Some(tx) = &c.to_host {
                while s.can_recv() {
                    let Ok(permit) = tx.try_reserve() else { break };
                    if let Ok(b) = s.recv(|b| {
                        let n = b.len().min(CHUNK);
                        (n, Bytes::copy_from_slice(&b[..n]))
                    }) {
                        permit.send(b);
                    }
                }
                if !s.may_recv()
                    && s.recv_queue() == 0
                    && s.state() != tcp::State::SynSent
                    && s.state() != tcp::State::SynReceived
                    && s.state() != tcp::State::Listen
                {
                    c.to_host = None; // the guest's FIN: the writer shuts the host side
                }
            }
            if matches!(s.state(), tcp::State::Closed | tcp::State::TimeWait) {
                if c.closing {
                    gone.push(*id);
                } else {
                    c.closing = true;
                }
            }
        }
        for id in gone {
            if let Some(c) = self.conns.remove(&id) {
                self.sockets.remove(c.handle);
            }
        }
    }

    fn service_dns(&mut self) {
        let world = self.policy.resolves_world();
        let s = self.sockets.get_mut::<udp::Socket>(self.dns);
        while let Ok((q, meta)) = s.recv() {
            match dns::plan(q, world) {
                Some(Plan::Reply(r)) => {
                    let _ = s.send_slice(&r, meta.endpoint);
                }
                Some(Plan::Resolve(name)) => {
                    let Ok(token) = self.dns_in_flight.clone().try_acquire_owned() else {
                        continue;
                    };
                    let (query, to, events) = (q.to_vec(), meta.endpoint, self.events.clone());
                    tokio::spawn(async move {
                        let _token = token;
                        let found = tokio::time::timeout(
                            Duration::from_secs(5),
                            tokio::net::lookup_host((name.as_str(), 0)),
                        )
                        .await;
                        let addrs: Option<Vec<Ipv4Addr>> = match found {
                            Ok(Ok(it)) => Some(
                                it.filter_map(|a| match a {
                                    SocketAddr::V4(v) => Some(*v.ip()),
                                    SocketAddr::V6(_) => None,
                                })
                                .collect(),
                            ),
                            _ => None,
                        };
                        if let Some(reply) = dns::answer(&query, addrs.as_deref()) {
                            let _ = events.send(Event::DnsAnswer { to, reply }).await;
                        }
                    });
                }
                None => {}
            }
        }
    }

    /// A UDP flow the policy allows: a socket for its destination in the stack and one
    /// on the host connected to its target.
    fn open_udp(&mut self, flow: Flow, target: SocketAddr) {
        if !self.udp_bound.contains_key(&flow.1) {
            let mut s = udp::Socket::new(
                udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 32], vec![0; 64 * 1024]),
                udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 32], vec![0; 64 * 1024]),
            );
            if s.bind(IpListenEndpoint {
                addr: Some(IpAddress::Ipv4(*flow.1.ip())),
                port: flow.1.port(),
            })
            .is_err()
            {
                return;
            }
            let h = self.sockets.add(s);
            self.udp_bound.insert(flow.1, h);
        }
        if self.udp_flows.contains_key(&flow) {
            return;
        }
        let bind: SocketAddr = if target.is_ipv4() {
            (Ipv4Addr::UNSPECIFIED, 0).into()
        } else {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        };
        let Ok(sock) = std::net::UdpSocket::bind(bind) else {
            return;
        };
        if sock.connect(target).is_err() || sock.set_nonblocking(true).is_err() {
            return;
        }
        let Ok(host) = UdpSocket::from_std(sock) else {
            return;
        };
        let host = Arc::new(host);
        let (h2, events) = (host.clone(), self.events.clone());
        let reader = tokio::spawn(async move {
            let mut buf = vec![0u8; 65536];
            while let Ok(n) = h2.recv(&mut buf).await {
                let data = buf[..n].to_vec();
                if events.send(Event::UdpReply { flow, data }).await.is_err() {
                    return;
                }
            }
        });
        self.udp_flows.insert(
            flow,
            UdpFlow {
                host,
                last: std::time::Instant::now(),
                reader,
            },
        );
    }

    fn service_udp(&mut self) {
        for (dst, h) in &self.udp_bound {
            let s = self.sockets.get_mut::<udp::Socket>(*h);
            while let Ok((data, meta)) = s.recv() {
                if let Some(f) = self.udp_flows.get_mut(&(meta.endpoint.port, *dst)) {
                    f.last = std::time::Instant::now();
                    // A full host socket drops the datagram, as UDP may.
                    let _ = f.host.try_send(data);
                }
            }
        }
    }

    fn sweep_udp(&mut self) {
        self.udp_flows.retain(|_, f| f.last.elapsed() < UDP_IDLE);
        let flows = &self.udp_flows;
        let sockets = &mut self.sockets;
        self.udp_bound.retain(|dst, h| {
            let used = flows.keys().any(|(_, d)| d == dst);
            if !used {
                sockets.remove(*h);
            }
            used
        });
    }
}

fn tcp_socket() -> tcp::Socket<'static> {
    let mut s = tcp::Socket::new(
        tcp::SocketBuffer::new(vec![0; TCP_BUFFER]),
        tcp::SocketBuffer::new(vec![0; TCP_BUFFER]),
    );
    s.set_nagle_enabled(false);
    s.set_timeout(Some(smoltcp::time::Duration::from_secs(120)));
    s
}

/// What the stack must know about a frame before smoltcp sees it.
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    /// The first SYN of a TCP connection the guest opens.
    Syn(Flow),
    /// A UDP datagram from the guest.
    Udp(Flow),
    /// An ARP question or a ping for an address that is not the gateway's or the DNS
    /// server's: nothing answers it.
    NotOurs,
}

fn inspect(f: &[u8]) -> Option<Seen> {
    let eth = EthernetFrame::new_checked(f).ok()?;
    let ours = |a: Ipv4Addr| a == GATEWAY || a == DNS;
    match eth.ethertype() {
        EthernetProtocol::Arp => {
            let arp = ArpPacket::new_checked(eth.payload()).ok()?;
            let target = Ipv4Addr::from(<[u8; 4]>::try_from(arp.target_protocol_addr()).ok()?);
            (arp.operation() == ArpOperation::Request && !ours(target)).then_some(Seen::NotOurs)
        }
        EthernetProtocol::Ipv4 => {
            let ip = Ipv4Packet::new_checked(eth.payload()).ok()?;
            let dst = ip.dst_addr();
            match ip.next_header() {
                IpProtocol::Tcp => {
                    let t = TcpPacket::new_checked(ip.payload()).ok()?;
                    (t.syn() && !t.ack())
                        .then(|| Seen::Syn((t.src_port(), SocketAddrV4::new(dst, t.dst_port()))))
                }
                IpProtocol::Udp => {
                    let u = UdpPacket::new_checked(ip.payload()).ok()?;
                    Some(Seen::Udp((
                        u.src_port(),
                        SocketAddrV4::new(dst, u.dst_port()),
                    )))
                }
                IpProtocol::Icmp => {
                    let i = Icmpv4Packet::new_checked(ip.payload()).ok()?;
                    (i.msg_type() == Icmpv4Message::EchoRequest && !ours(dst))
                        .then_some(Seen::NotOurs)
                }
                _ => None,
            }
        }
        _ => None,
    }
}

/// Carries frames between QEMU's `stream` netdev (each frame after its length as a
/// 4-byte big-endian number) and the stack. QEMU connects again after a restore; the
/// newest connection is the guest's.
pub(crate) async fn serve_qemu(listener: UnixListener, events: mpsc::Sender<Event>) {
    while let Ok((conn, _)) = listener.accept().await {
        let (tx, rx) = mpsc::channel::<Vec<u8>>(1024);
        if events.send(Event::Qemu(tx)).await.is_err() {
            return;
        }
        let (rd, wr) = conn.into_split();
        tokio::spawn(write_frames(wr, rx));
        tokio::spawn(read_frames(rd, events.clone()));
    }
}

async fn read_frames(mut rd: tokio::net::unix::OwnedReadHalf, events: mpsc::Sender<Event>) {
    let mut len = [0u8; 4];
    loop {
        if rd.read_exact(&mut len).await.is_err() {
            return;
        }
        let n = u32::from_be_bytes(len) as usize;
        if n > MAX_FRAME {
            tracing::warn!(
                bytes = n,
                "QEMU sent a frame larger than the link's; closing"
            );
            return;
        }
        let mut f = vec![0u8; n];
        if rd.read_exact(&mut f).await.is_err() {
            return;
        }
        if events.send(Event::Frame(f)).await.is_err() {
            return;
        }
    }
}

async fn write_frames(mut wr: tokio::net::unix::OwnedWriteHalf, mut rx: mpsc::Receiver<Vec<u8>>) {
    while let Some(f) = rx.recv().await {
        let mut b = Vec::with_capacity(4 + f.len());
        b.extend_from_slice(&(f.len() as u32).to_be_bytes());
        b.extend_from_slice(&f);
        if wr.write_all(&b).await.is_err() {
            return;
        }
    }
}
