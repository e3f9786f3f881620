//! Resolving an image's `User` (`name`, `uid`, `name:group`, `uid:gid`) as docker does,
//! from the env's /etc/passwd and /etc/group.

#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Ids {
    pub(crate) uid: u32,
    pub(crate) gid: u32,
    pub(crate) groups: Vec<u32>,
    pub(crate) home: String,
}

/// Resolves an image `User` the way docker does, from the env's /etc/passwd and /etc/group.
pub(crate) fn resolve_user(spec: &str) -> Result<Ids, String> {
    // Called after `boot` moved the agent into the sandbox root.
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    resolve_user_in(spec, &read("/etc/passwd"), &read("/etc/group"))
}

/// `resolve_user` over the given passwd and group files' contents.
fn resolve_user_in(spec: &str, passwd: &str, group: &str) -> Result<Ids, String> {
    let (u, g) = match spec.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (spec, None),
    };
    let u = if u.is_empty() { "0" } else { u };
    let entry = passwd
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .find(|f| f.len() >= 7 && (f[0] == u || (u.parse::<u32>().is_ok() && f[2] == u)));
    let (uid, mut gid, name, home) = match (&entry, u.parse::<u32>()) {
        (Some(f), _) => (
            f[2].parse().unwrap_or(0),
            f[3].parse().unwrap_or(0),
            f[0].to_string(),
            f[5].to_string(),
        ),
        (None, Ok(n)) => (n, 0, String::new(), "/".to_string()),
        (None, Err(_)) => {
            return Err(format!(
                "unable to find user {u}: no matching entries in passwd file"
            ))
        }
    };
    if let Some(g) = g {
        gid = match g.parse::<u32>() {
            Ok(n) => n,
            Err(_) => group
                .lines()
                .map(|l| l.split(':').collect::<Vec<_>>())
                .find(|f| f.len() >= 3 && f[0] == g)
                .and_then(|f| f[2].parse().ok())
                .ok_or_else(|| {
                    format!("unable to find group {g}: no matching entries in group file")
                })?,
        };
    }
    let mut groups = vec![gid];
    if !name.is_empty() && g.is_none() {
        for f in group.lines().map(|l| l.split(':').collect::<Vec<_>>()) {
            if f.len() >= 4 && f[3].split(',').any(|m| m == name) {
                if let Ok(n) = f[2].parse::<u32>() {
                    if !groups.contains(&n) {
                        groups.push(n);
                    }
                }
            }
        }
    }
    Ok(Ids {
        uid,
        gid,
        groups,
        home: if home.is_empty() { "/".into() } else { home },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\napp:x:1000:1000::/home/app:/bin/sh\nnohome:x:1001:1001:::/bin/sh\n";
    const GROUP: &str = "root:x:0:\napp:x:1000:\ndocker:x:999:app,other\nstaff:x:50:\n";

    fn ids(spec: &str) -> Result<Ids, String> {
        resolve_user_in(spec, PASSWD, GROUP)
    }

    #[test]
    fn users_resolve_as_docker_resolves_them() {
        let root = ids("").unwrap();
        assert_eq!((root.uid, root.gid, root.home.as_str()), (0, 0, "/root"));
        let app = ids("app").unwrap();
        assert_eq!((app.uid, app.gid), (1000, 1000));
        assert_eq!(
            app.groups,
            [1000, 999],
            "supplementary groups from /etc/group"
        );
        assert_eq!(app.home, "/home/app");
        assert_eq!(ids("1000").unwrap().uid, 1000, "a uid finds its entry");
        let named = ids("app:staff").unwrap();
        assert_eq!(
            (named.gid, named.groups.clone()),
            (50, vec![50]),
            "an explicit group replaces the supplementary ones"
        );
        assert_eq!(ids("app:7").unwrap().gid, 7);
        let unknown_uid = ids("4242").unwrap();
        assert_eq!(
            (unknown_uid.uid, unknown_uid.gid, unknown_uid.home.as_str()),
            (4242, 0, "/")
        );
        assert_eq!(ids("nohome").unwrap().home, "/", "an empty home is /");
    }

    #[test]
    fn unknown_names_are_errors() {
        assert!(ids("ghost")
            .unwrap_err()
            .contains("unable to find user ghost"));
        assert!(ids("app:ghosts")
            .unwrap_err()
            .contains("unable to find group ghosts"));
    }
}
