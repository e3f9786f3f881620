//! The sandbox's DNS server (at `DNS`:53): the gateway's name answered here, names of the
//! world resolved by the host's resolver when the policy allows the world at all. IPv4
//! only: the sandbox has no IPv6 route, so AAAA questions get an empty answer (not an
//! error, so resolvers go on to A).

use std::net::Ipv4Addr;

use simple_dns::rdata::{RData, A};
use simple_dns::{Name, Packet, PacketFlag, ResourceRecord, CLASS, QTYPE, RCODE, TYPE};

use crate::{GATEWAY, HOST_NAME};

/// Seconds a resolver in the guest may keep an answer.
const TTL: u32 = 60;

/// What to do with one query.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Plan {
    /// Send this reply.
    Reply(Vec<u8>),
    /// Resolve `name` on the host, then reply with `answer`.
    Resolve(String),
}

/// The plan for `query`, or `None` when it is not a DNS query this server reads (it is
/// dropped, as a server drops garbage).
pub(crate) fn plan(query: &[u8], resolves_world: bool) -> Option<Plan> {
    let p = Packet::parse(query).ok()?;
    if p.has_flags(PacketFlag::RESPONSE) {
        return None;
    }
    let Some(q) = p.questions.first() else {
        return Some(Plan::Reply(reply(query, RCODE::FormatError, &[])?));
    };
    let name = q
        .qname
        .to_string()
        .trim_end_matches('.')
        .to_ascii_lowercase();
    let local = name == HOST_NAME;
    Some(match q.qtype {
        QTYPE::TYPE(TYPE::A) if local => Plan::Reply(reply(query, RCODE::NoError, &[GATEWAY])?),
        QTYPE::TYPE(TYPE::A) if resolves_world => Plan::Resolve(name),
        QTYPE::TYPE(TYPE::AAAA) if local || resolves_world => {
            Plan::Reply(reply(query, RCODE::NoError, &[])?)
        }
        QTYPE::TYPE(TYPE::A | TYPE::AAAA) => Plan::Reply(reply(query, RCODE::NameError, &[])?),
        _ => Plan::Reply(reply(query, RCODE::NotImplemented, &[])?),
    })
}

/// The reply to `query` with the host's resolution of its name: its IPv4 addresses, or
/// `None` when the name does not resolve.
pub(crate) fn answer(query: &[u8], addrs: Option<&[Ipv4Addr]>) -> Option<Vec<u8>> {
    match addrs {
        Some(a) if !a.is_empty() => reply(query, RCODE::NoError, a),
        _ => reply(query, RCODE::NameError, &[]),
    }
}

fn reply(query: &[u8], rcode: RCODE, addrs: &[Ipv4Addr]) -> Option<Vec<u8>> {
    let q = Packet::parse(query).ok()?;
    let mut r = Packet::new_reply(q.id());
    r.set_flags(PacketFlag::RECURSION_AVAILABLE);
    if q.has_flags(PacketFlag::RECURSION_DESIRED) {
        r.set_flags(PacketFlag::RECURSION_DESIRED);
    }
    *r.rcode_mut() = rcode;
    r.questions = q.questions.clone();
    if let Some(first) = q.questions.first() {
        for a in addrs {
            r.answers.push(ResourceRecord::new(
                Name::new_unchecked(&first.qname.to_string()).into_owned(),
                CLASS::IN,
                TTL,
                RData::A(A::from(*a)),
            ));
        }
    }
    r.build_bytes_vec_compressed().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use simple_dns::{Question, QCLASS};

    fn query(name: &str, t: TYPE) -> Vec<u8> {
        let mut p = Packet::new_query(7);
        p.set_flags(PacketFlag::RECURSION_DESIRED);
        p.questions.push(Question::new(
            Name::new_unchecked(name),
            QTYPE::TYPE(t),
            QCLASS::CLASS(CLASS::IN),
            false,
        ));
        p.build_bytes_vec().unwrap()
    }

    fn parsed(b: &[u8]) -> (u16, RCODE, Vec<String>) {
        let p = Packet::parse(b).unwrap();
        let a = p
            .answers
            .iter()
            .map(|r| match &r.rdata {
                RData::A(a) => Ipv4Addr::from(a.address).to_string(),
                o => format!("{o:?}"),
            })
            .collect();
        assert!(p.has_flags(PacketFlag::RESPONSE));
        (p.id(), p.rcode(), a)
    }

    #[test]
    fn the_gateway_has_a_name_whatever_the_policy() {
        for world in [false, true] {
            let Some(Plan::Reply(r)) = plan(&query("Host.Amber.Internal", TYPE::A), world) else {
                panic!("no reply")
            };
            assert_eq!(
                parsed(&r),
                (7, RCODE::NoError, vec!["10.0.2.2".to_string()])
            );
        }
    }

    #[test]
    fn names_of_the_world_resolve_only_when_the_world_is_allowed() {
        let q = query("example.com", TYPE::A);
        assert_eq!(plan(&q, true), Some(Plan::Resolve("example.com".into())));
        let Some(Plan::Reply(r)) = plan(&q, false) else {
            panic!()
        };
        assert_eq!(parsed(&r).1, RCODE::NameError);
        let r = answer(&q, Some(&["192.0.2.1".parse().unwrap()])).unwrap();
        assert_eq!(
            parsed(&r),
            (7, RCODE::NoError, vec!["192.0.2.1".to_string()])
        );
        assert_eq!(parsed(&answer(&q, None).unwrap()).1, RCODE::NameError);
        let Some(Plan::Reply(r)) = plan(&query("example.com", TYPE::AAAA), true) else {
            panic!()
        };
        assert_eq!(parsed(&r), (7, RCODE::NoError, vec![]));
        let Some(Plan::Reply(r)) = plan(&query("example.com", TYPE::MX), true) else {
            panic!()
        };
        assert_eq!(parsed(&r).1, RCODE::NotImplemented);
    }

    #[test]
    fn garbage_is_dropped() {
        assert_eq!(plan(b"", true), None);
        assert_eq!(plan(&[0xff; 40], true), None);
    }
}
