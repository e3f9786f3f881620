//! Who may do what: users and pull-only robots from a users file (argon2-hashed secrets),
//! Basic auth, the Docker token flow (`GET /token` issues HS256 JWTs with access claims,
//! `WWW-Authenticate: Bearer realm,service,scope` points clients to it), and pull and push
//! rights per repository prefix. Failed logins are rate-limited per account and logged.
//!
//! Invariants kept here:
//! - a robot never holds a push right (refused when the file is loaded);
//! - a token grants at most what its subject was allowed when it was issued, and is
//!   refused after `exp`, before `nbf`, for another audience, or with a bad signature;
//! - push implies pull (a client that pushes reads back what it pushed).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::Argon2;
use base64::Engine;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

/// Failed logins allowed per account within `FAILURE_WINDOW` before answers are 429.
pub const MAX_FAILURES: usize = 5;
pub const FAILURE_WINDOW: Duration = Duration::from_secs(60);
/// A verified Basic credential is trusted again without argon2 for this long.
const VERIFIED_TTL: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("users file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("users file {path}: {msg}")]
    Invalid { path: PathBuf, msg: String },
    #[error("token key {path}: {source}")]
    Key {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// What a right is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Pull,
    Push,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Pull => "pull",
            Action::Push => "push",
        }
    }
}

/// One account of the users file (`[[user]]` tables).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Account {
    pub name: String,
    /// argon2 PHC string of the password (or of the robot's token).
    pub password: String,
    /// Repository prefixes this account may pull (`*` for all).
    #[serde(default)]
    pub pull: Vec<String>,
    /// Repository prefixes this account may push (and pull).
    #[serde(default)]
    pub push: Vec<String>,
    /// A robot: pull-only, for runners.
    #[serde(default)]
    pub robot: bool,
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct UsersFile {
    #[serde(default, rename = "user")]
    pub users: Vec<Account>,
}

impl UsersFile {
    pub fn load(path: &Path) -> Result<UsersFile, AuthError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(source) => {
                return Err(AuthError::Read {
                    path: path.into(),
                    source,
                })
            }
        };
        let invalid = |msg: String| AuthError::Invalid {
            path: path.into(),
            msg,
        };
        let file: UsersFile = toml::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        let mut seen = std::collections::HashSet::new();
        for u in &file.users {
            if !seen.insert(u.name.as_str()) {
                return Err(invalid(format!("user {:?} is listed twice", u.name)));
            }
            if u.name.is_empty() || u.name.contains(':') {
                return Err(invalid(format!(
                    "user name {:?} is empty or has a ':'",
                    u.name
                )));
            }
            if u.robot && !u.push.is_empty() {
                return Err(invalid(format!(
                    "robot {:?} has push rights: robots are pull-only",
                    u.name
                )));
            }
            PasswordHash::new(&u.password).map_err(|e| {
                invalid(format!(
                    "user {:?}: password is not an argon2 hash: {e}",
                    u.name
                ))
            })?;
        }
        Ok(file)
    }

    /// Writes the file atomically (temporary file + rename), mode 0600.
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let text = toml::to_string_pretty(self).map_err(std::io::Error::other)?;
        let tmp = path.with_extension("tmp");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    }

    /// Adds or replaces an account.
    pub fn upsert(&mut self, account: Account) {
        self.users.retain(|u| u.name != account.name);
        self.users.push(account);
        self.users.sort_by(|a, b| a.name.cmp(&b.name));
    }
}

/// An argon2id PHC string of `secret` with a fresh salt.
pub fn hash_secret(secret: &str) -> String {
    let salt = SaltString::encode_b64(uuid::Uuid::new_v4().as_bytes()).expect("16 bytes encode");
    Argon2::default()
        .hash_password(secret.as_bytes(), &salt)
        .expect("argon2 hashes")
        .to_string()
}

/// Whether `pattern` (a repository prefix, or `*`) covers `repo`: `team` covers `team`
/// and `team/...`, never `teammate`.
pub fn covers(pattern: &str, repo: &str) -> bool {
    let p = pattern.trim_end_matches('/');
    p == "*" || repo == p || repo.strip_prefix(p).is_some_and(|r| r.starts_with('/'))
}

/// A right on one repository, as a token carries it.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct AccessEntry {
    #[serde(rename = "type")]
    pub kind: String,
    pub name: String,
    pub actions: Vec<String>,
}

#[derive(Debug, Deserialize, Serialize)]
pub struct Claims {
    pub iss: String,
    pub sub: String,
    pub aud: String,
    pub exp: u64,
    pub nbf: u64,
    pub iat: u64,
    pub jti: String,
    #[serde(default)]
    pub access: Vec<AccessEntry>,
}

/// Who made a request.
#[derive(Debug)]
pub enum Principal {
    /// Basic auth with a verified password or robot token: the account's own rights.
    Account(Account),
    /// A bearer token: the rights it carries.
    Token(Claims),
}

impl Principal {
    pub fn name(&self) -> &str {
        match self {
            Principal::Account(a) => &a.name,
            Principal::Token(c) => &c.sub,
        }
    }

    pub fn may(&self, action: Action, repo: &str) -> bool {
        match self {
            Principal::Account(a) => account_may(a, action, repo),
            Principal::Token(c) => c.access.iter().any(|e| {
                e.kind == "repository"
                    && e.name == repo
                    && e.actions
                        .iter()
                        .any(|x| x == action.as_str() || (action == Action::Pull && x == "push"))
            }),
        }
    }

    /// Whether it may pull anything at all (content-addressed chunks and envs).
    pub fn may_pull_some(&self) -> bool {
        match self {
            Principal::Account(a) => !a.pull.is_empty() || !a.push.is_empty(),
            Principal::Token(c) => !c.access.is_empty(),
        }
    }

    /// The account whose pull rights filter what repository listings show (the
    /// catalog): the account itself, or a token's subject as the users file has it now,
    /// looked up once per listing. `None` when a token's account no longer exists: such
    /// a token lists nothing.
    pub fn lister(&self, auth: &Auth) -> Option<Account> {
        match self {
            Principal::Account(a) => Some(a.clone()),
            Principal::Token(c) => auth.account(&c.sub),
        }
    }
}

impl Account {
    /// Whether this account may pull `repo` (and so see it listed).
    pub fn may_pull(&self, repo: &str) -> bool {
        account_may(self, Action::Pull, repo)
    }
}

fn account_may(a: &Account, action: Action, repo: &str) -> bool {
    let push = a.push.iter().any(|p| covers(p, repo));
    match action {
        Action::Push => !a.robot && push,
        Action::Pull => push || a.pull.iter().any(|p| covers(p, repo)),
    }
}

/// Why a request has no principal.
#[derive(Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No credentials, or credentials that do not verify: 401.
    Unauthenticated(String),
    /// Too many failed logins for this account: 429.
    RateLimited(String),
}

/// The registry's authenticator: accounts, the token key, failed-login bookkeeping.
pub struct Auth {
    users_path: PathBuf,
    /// The accounts, and the users file's mtime when they were read.
    accounts: Mutex<(Option<std::time::SystemTime>, HashMap<String, Account>)>,
    key: Vec<u8>,
    pub service: String,
    pub token_ttl: Duration,
    /// sha256(user:secret) -> when it was verified.
    verified: Mutex<HashMap<[u8; 32], Instant>>,
    failures: Mutex<HashMap<String, Vec<Instant>>>,
}

impl Auth {
    /// Loads the users file and the token signing key (`key_path`, 32 random bytes made
    /// on first use, mode 0600).
    pub fn open(
        users_path: &Path,
        key_path: &Path,
        service: String,
        token_ttl: Duration,
    ) -> Result<Auth, AuthError> {
        let mtime = mtime(users_path);
        let file = UsersFile::load(users_path)?;
        let key = load_or_make_key(key_path).map_err(|source| AuthError::Key {
            path: key_path.into(),
            source,
        })?;
        Ok(Auth {
            users_path: users_path.into(),
            accounts: Mutex::new((mtime, by_name(file))),
            key,
            service,
            token_ttl,
            verified: Mutex::new(HashMap::new()),
            failures: Mutex::new(HashMap::new()),
        })
    }

    /// The account `name`. The users file is read again when it changed, so accounts
    /// added with `amber-registry user add` count without a restart; a broken file
    /// keeps the accounts already loaded (and says why in the log).
    pub fn account(&self, name: &str) -> Option<Account> {
        let mut accounts = self.accounts.lock().unwrap();
        let now = mtime(&self.users_path);
        if now != accounts.0 {
            match UsersFile::load(&self.users_path) {
                Ok(file) => {
                    *accounts = (now, by_name(file));
                    self.verified.lock().unwrap().clear();
                }
                Err(e) => tracing::error!(err = %e, "users file not reloaded"),
            }
        }
        accounts.1.get(name).cloned()
    }

    /// The principal of an `Authorization` header value (None: no header).
    pub fn authenticate(&self, authorization: Option<&str>) -> Result<Principal, Refusal> {
        let Some(value) = authorization else {
            return Err(Refusal::Unauthenticated("authentication required".into()));
        };
        if let Some(token) = value.strip_prefix("Bearer ") {
            return self.verify_token(token.trim()).map(Principal::Token);
        }
        if let Some(b64) = value.strip_prefix("Basic ") {
            let (user, secret) = decode_basic(b64.trim())
                .ok_or_else(|| Refusal::Unauthenticated("malformed Basic credentials".into()))?;
            return self.login(&user, &secret).map(Principal::Account);
        }
        Err(Refusal::Unauthenticated(
            "unsupported authorization scheme (use Basic or Bearer)".into(),
        ))
    }

    /// Checks a user name and password (or robot token).
    pub fn login(&self, user: &str, secret: &str) -> Result<Account, Refusal> {
        let now = Instant::now();
        {
            let mut failures = self.failures.lock().unwrap();
            let recent = failures.entry(user.to_string()).or_default();
            recent.retain(|t| now.duration_since(*t) < FAILURE_WINDOW);
            if recent.len() >= MAX_FAILURES {
                tracing::warn!(user, "login refused: too many failed logins");
                return Err(Refusal::RateLimited(format!(
                    "too many failed logins for {user:?}; try again in {} s",
                    FAILURE_WINDOW.as_secs()
                )));
            }
        }
        let fingerprint: [u8; 32] = Sha256::digest(format!("{user}:{secret}")).into();
        let account = self.account(user);
        if let Some(a) = &account {
            let mut verified = self.verified.lock().unwrap();
            verified.retain(|_, t| now.duration_since(*t) < VERIFIED_TTL);
            if verified.contains_key(&fingerprint) {
                return Ok(a.clone());
            }
        }
        let ok = account.as_ref().is_some_and(|a| {
            PasswordHash::new(&a.password)
                .map(|h| {
                    Argon2::default()
                        .verify_password(secret.as_bytes(), &h)
                        .is_ok()
                })
                .unwrap_or(false)
        });
        if ok {
            self.verified.lock().unwrap().insert(fingerprint, now);
            return Ok(account.expect("checked"));
        }
        self.failures
            .lock()
            .unwrap()
            .entry(user.to_string())
            .or_default()
            .push(now);
        tracing::warn!(user, known = account.is_some(), "failed login");
        Err(Refusal::Unauthenticated(format!(
            "invalid user name or password for {user:?}"
        )))
    }

    /// A token for `account` granting what it asks in `scopes` (Docker's
    /// `repository:<name>:<actions>`), cut to what the account may do.
    pub fn issue(&self, account: &Account, scopes: &[String]) -> (String, Claims) {
        let now = crate::clock::now_unix();
        let mut access: Vec<AccessEntry> = Vec::new();
        for scope in scopes {
            for s in scope.split(' ') {
                let Some((kind, rest)) = s.split_once(':') else {
                    continue;
                };
                let Some((name, actions)) = rest.rsplit_once(':') else {
                    continue;
                };
                if kind != "repository" {
                    continue;
                }
                let granted: Vec<String> = actions
                    .split(',')
                    .filter(|a| match *a {
                        "pull" => account_may(account, Action::Pull, name),
                        "push" => account_may(account, Action::Push, name),
                        _ => false,
                    })
                    .map(str::to_string)
                    .collect();
                if !granted.is_empty() {
                    access.push(AccessEntry {
                        kind: kind.into(),
                        name: name.into(),
                        actions: granted,
                    });
                }
            }
        }
        let claims = Claims {
            iss: "amber".into(),
            sub: account.name.clone(),
            aud: self.service.clone(),
            exp: now + self.token_ttl.as_secs(),
            nbf: now.saturating_sub(5),
            iat: now,
            jti: uuid::Uuid::new_v4().to_string(),
            access,
        };
        let token = jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &EncodingKey::from_secret(&self.key),
        )
        .expect("HS256 encodes");
        (token, claims)
    }

    /// A session of the catalog pages for `account`, valid for `ttl`: a token with no
    /// access of its own (the account's rights as the users file has them apply at each
    /// request) and an audience of its own, so the API never takes it as a bearer token.
    pub fn issue_session(&self, account: &Account, ttl: Duration) -> String {
        let now = crate::clock::now_unix();
        let claims = Claims {
            iss: "amber".into(),
            sub: account.name.clone(),
            aud: self.session_audience(),
            exp: now + ttl.as_secs(),
            nbf: now.saturating_sub(5),
            iat: now,
            jti: uuid::Uuid::new_v4().to_string(),
            access: Vec::new(),
        };
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &EncodingKey::from_secret(&self.key),
        )
        .expect("HS256 encodes")
    }

    /// The account of a catalog-page session, as the users file has it now.
    pub fn session_account(&self, token: &str) -> Result<Account, Refusal> {
        let claims = self.verify_for(token, &self.session_audience())?;
        self.account(&claims.sub).ok_or_else(|| {
            Refusal::Unauthenticated(format!("account {:?} no longer exists", claims.sub))
        })
    }

    fn session_audience(&self) -> String {
        format!("{}/ui", self.service)
    }

    fn verify_token(&self, token: &str) -> Result<Claims, Refusal> {
        self.verify_for(token, &self.service)
    }

    fn verify_for(&self, token: &str, audience: &str) -> Result<Claims, Refusal> {
        let mut v = Validation::new(Algorithm::HS256);
        v.set_audience(&[audience]);
        v.set_issuer(&["amber"]);
        v.leeway = 0;
        v.validate_nbf = true;
        jsonwebtoken::decode::<Claims>(token, &DecodingKey::from_secret(&self.key), &v)
            .map(|d| d.claims)
            .map_err(|e| Refusal::Unauthenticated(format!("invalid token: {e}")))
    }
}

fn mtime(path: &Path) -> Option<std::time::SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

fn by_name(file: UsersFile) -> HashMap<String, Account> {
    file.users
        .into_iter()
        .map(|u| (u.name.clone(), u))
        .collect()
}

fn decode_basic(b64: &str) -> Option<(String, String)> {
    let raw = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
    let text = String::from_utf8(raw).ok()?;
    let (u, p) = text.split_once(':')?;
    Some((u.to_string(), p.to_string()))
}

fn load_or_make_key(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::read(path) {
        Ok(k) if k.len() >= 32 => return Ok(k),
        Ok(_) => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "shorter than 32 bytes",
            ))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut key = Vec::with_capacity(32);
    key.extend_from_slice(uuid::Uuid::new_v4().as_bytes());
    key.extend_from_slice(uuid::Uuid::new_v4().as_bytes());
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(&key)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn account(name: &str, pull: &[&str], push: &[&str], robot: bool) -> Account {
        Account {
            name: name.into(),
            password: hash_secret("secret"),
            pull: pull.iter().map(|s| s.to_string()).collect(),
            push: push.iter().map(|s| s.to_string()).collect(),
            robot,
        }
    }

    fn auth_with(accounts: &[Account]) -> (tempfile::TempDir, Auth) {
        let dir = tempfile::tempdir().unwrap();
        let users = dir.path().join("users.toml");
        UsersFile {
            users: accounts.to_vec(),
        }
        .save(&users)
        .unwrap();
        let auth = Auth::open(
            &users,
            &dir.path().join("key"),
            "amber".into(),
            Duration::from_secs(300),
        )
        .unwrap();
        (dir, auth)
    }

    #[test]
    fn prefixes_cover_the_repository_and_below_only() {
        assert!(covers("team", "team"));
        assert!(covers("team/", "team/app"));
        assert!(covers("team", "team/app/x"));
        assert!(!covers("team", "teammate"));
        assert!(covers("*", "anything/at/all"));
    }

    #[test]
    fn robots_are_pull_only_and_push_implies_pull() {
        let robot = account("r", &["envs"], &[], true);
        assert!(account_may(&robot, Action::Pull, "envs/x"));
        assert!(!account_may(&robot, Action::Push, "envs/x"));
        let dev = account("d", &[], &["team"], false);
        assert!(account_may(&dev, Action::Pull, "team/x"));
        assert!(!account_may(&dev, Action::Pull, "other"));
    }

    #[test]
    fn a_robot_with_push_rights_is_refused_at_load() {
        let dir = tempfile::tempdir().unwrap();
        let users = dir.path().join("users.toml");
        UsersFile {
            users: vec![account("r", &[], &["x"], true)],
        }
        .save(&users)
        .unwrap();
        let err = UsersFile::load(&users).unwrap_err().to_string();
        assert!(err.contains("robots are pull-only"), "{err}");
    }

    #[test]
    fn tokens_carry_only_granted_actions_and_tampering_is_refused() {
        let (_d, auth) = auth_with(&[account("alice", &["*"], &["team"], false)]);
        let alice = auth.account("alice").unwrap();
        let (token, claims) = auth.issue(
            &alice,
            &[
                "repository:team/app:pull,push".into(),
                "repository:other:pull,push".into(),
            ],
        );
        assert_eq!(claims.access.len(), 2);
        assert_eq!(claims.access[0].actions, ["pull", "push"]);
        assert_eq!(claims.access[1].actions, ["pull"]);
        let p = auth.authenticate(Some(&format!("Bearer {token}"))).unwrap();
        assert!(p.may(Action::Push, "team/app"));
        assert!(!p.may(Action::Push, "other"));
        assert!(!p.may(Action::Pull, "third"));
        // Flip one character of the payload.
        let mut parts: Vec<String> = token.split('.').map(str::to_string).collect();
        let c = parts[1].pop().unwrap();
        parts[1].push(if c == 'A' { 'B' } else { 'A' });
        let tampered = parts.join(".");
        assert!(matches!(
            auth.authenticate(Some(&format!("Bearer {tampered}"))),
            Err(Refusal::Unauthenticated(_))
        ));
    }

    #[test]
    fn failed_logins_are_rate_limited_per_account() {
        let (_d, auth) = auth_with(&[account("alice", &["*"], &[], false)]);
        for _ in 0..MAX_FAILURES {
            assert!(matches!(
                auth.login("alice", "wrong"),
                Err(Refusal::Unauthenticated(_))
            ));
        }
        // Even the right password is refused until the window passes.
        assert!(matches!(
            auth.login("alice", "secret"),
            Err(Refusal::RateLimited(_))
        ));
        assert!(auth.login("bob", "secret").is_err());
    }
}
