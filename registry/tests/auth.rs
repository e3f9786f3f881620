//! Authentication and per-repository rights with real clients: `docker login` + push +
//! pull through the token flow, a pull-only robot, anonymous and forged requests, and
//! failed-login rate limiting. `scripts/test` starts the Docker engine.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use base64::Engine;
use common::*;

/// The registry binary with `args`, standard input `stdin`; (status ok, stdout, stderr).
fn registry_cli(args: &[&str], stdin: &str) -> (bool, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_amber-registry"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// alice pushes under `team`, bob pulls everything, `runner` is a robot pulling
/// `team/app`. Returns the users file and the robot's token.
fn accounts(dir: &Path) -> (PathBuf, String) {
    let users = dir.join("users.toml");
    let u = users.to_str().unwrap();
    let (ok, _, err) = registry_cli(
        &["user", "add", "alice", "--users", u, "--push", "team"],
        "alice-pw\n",
    );
    assert!(ok, "{err}");
    let (ok, _, err) = registry_cli(
        &["user", "add", "bob", "--users", u, "--pull", "*"],
        "bob-pw\n",
    );
    assert!(ok, "{err}");
    let (ok, token, err) = registry_cli(
        &[
            "user", "robot", "runner", "--users", u, "--pull", "team/app",
        ],
        "",
    );
    assert!(ok, "{err}");
    let token = token.trim().to_string();
    assert!(token.starts_with("amber_") && token.len() > 40, "{token:?}");
    (users, token)
}

fn basic(user: &str, secret: &str) -> String {
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("{user}:{secret}"))
    )
}

/// A token from the registry's token endpoint.
async fn token(s: &Server, user: &str, secret: &str, scope: &str) -> String {
    let r = client()
        .get(s.url(&format!("/token?service=amber&scope={scope}")))
        .header("Authorization", basic(user, secret))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "token for {user}");
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["expires_in"], 300);
    v["token"].as_str().unwrap().to_string()
}

/// The docker CLI with its own config directory (its own logins).
fn docker_as(config: &Path, args: &[&str], stdin: Option<&str>) -> (bool, String) {
    let mut child = docker()
        .arg("--config")
        .arg(config)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut pipe = child.stdin.take().unwrap();
    if let Some(s) = stdin {
        pipe.write_all(s.as_bytes()).unwrap();
    }
    drop(pipe);
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// A one-file image tar for `docker import`.
fn image_tar(dir: &Path, content: &str) -> PathBuf {
    let path = dir.join("rootfs.tar");
    let mut b = tar::Builder::new(std::fs::File::create(&path).unwrap());
    let mut h = tar::Header::new_gnu();
    h.set_size(content.len() as u64);
    h.set_mode(0o644);
    h.set_cksum();
    b.append_data(&mut h, "hello.txt", content.as_bytes())
        .unwrap();
    b.finish().unwrap();
    path
}

fn start_with_auth(users: &Path) -> Server {
    Server::start(&["--auth", "token", "--users", users.to_str().unwrap()])
}

#[tokio::test]
async fn docker_login_push_pull_with_token_auth_and_a_pull_only_robot() {
    let tmp = tempfile::tempdir().unwrap();
    let (users, robot_token) = accounts(tmp.path());
    let s = start_with_auth(&users);
    let alice_cfg = tmp.path().join("docker-alice");
    let robot_cfg = tmp.path().join("docker-robot");
    let (ok, out) = docker_as(
        &alice_cfg,
        &["login", "-u", "alice", "--password-stdin", &s.addr],
        Some("alice-pw\n"),
    );
    assert!(ok && out.contains("Login Succeeded"), "{out}");
    // A wrong password is refused by `docker login` too.
    let (ok, out) = docker_as(
        &tmp.path().join("docker-mallory"),
        &["login", "-u", "alice", "--password-stdin", &s.addr],
        Some("wrong\n"),
    );
    assert!(!ok && out.contains("unauthorized"), "{out}");

    let image = format!("{}/team/app:v1", s.addr);
    let tar = image_tar(tmp.path(), "hello from behind auth\n");
    docker_as(&alice_cfg, &["import", tar.to_str().unwrap(), &image], None);
    let (ok, out) = docker_as(&alice_cfg, &["push", &image], None);
    assert!(ok, "alice's push: {out}");
    let (ok, out) = docker_as(&alice_cfg, &["rmi", &image], None);
    assert!(ok, "{out}");

    // The robot logs in with its token and pulls, but cannot push.
    let (ok, out) = docker_as(
        &robot_cfg,
        &["login", "-u", "runner", "--password-stdin", &s.addr],
        Some(&format!("{robot_token}\n")),
    );
    assert!(ok, "{out}");
    let (ok, out) = docker_as(&robot_cfg, &["pull", &image], None);
    assert!(ok, "the robot's pull: {out}");
    let pushed_by_robot = format!("{}/team/app:robot", s.addr);
    docker_as(&robot_cfg, &["tag", &image, &pushed_by_robot], None);
    let (ok, out) = docker_as(&robot_cfg, &["push", &pushed_by_robot], None);
    assert!(!ok, "a robot pushed: {out}");
    assert!(
        out.contains("denied") || out.contains("unauthorized"),
        "{out}"
    );
    docker_as(&robot_cfg, &["rmi", &image, &pushed_by_robot], None);

    // Nothing was written by the refused push.
    let r = client()
        .get(s.url("/v2/team/app/tags/list"))
        .header("Authorization", basic("bob", "bob-pw"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let tags: serde_json::Value = r.json().await.unwrap();
    assert_eq!(tags["tags"], serde_json::json!(["v1"]));
}

#[tokio::test]
async fn rights_follow_repository_prefixes() {
    let tmp = tempfile::tempdir().unwrap();
    let (users, robot_token) = accounts(tmp.path());
    let s = start_with_auth(&users);
    let alice = token(&s, "alice", "alice-pw", "repository:team/app:pull,push").await;
    let other = token(&s, "alice", "alice-pw", "repository:team/other:pull,push").await;
    // alice pushes into two repositories of her prefix through bearer tokens.
    for (repo, t) in [("team/app", &alice), ("team/other", &other)] {
        let data = format!("blob of {repo}");
        let r = client()
            .post(s.url(&format!(
                "/v2/{repo}/blobs/uploads/?digest={}",
                sha256(data.as_bytes())
            )))
            .header("Authorization", format!("Bearer {t}"))
            .body(data)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201, "{repo}");
    }
    // A token for team/app does not open team/other.
    let r = client()
        .get(s.url("/v2/team/other/tags/list"))
        .header("Authorization", format!("Bearer {alice}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert!(r.headers()["www-authenticate"]
        .to_str()
        .unwrap()
        .contains("scope=\"repository:team/other:pull\""));
    // alice may not push outside her prefix: the token leaves the action out.
    let outside = token(&s, "alice", "alice-pw", "repository:elsewhere:pull,push").await;
    let r = client()
        .post(s.url("/v2/elsewhere/blobs/uploads/"))
        .header("Authorization", format!("Bearer {outside}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    // With Basic auth the same refusal is 403 DENIED.
    let r = client()
        .post(s.url("/v2/elsewhere/blobs/uploads/"))
        .header("Authorization", basic("alice", "alice-pw"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    assert_eq!(error_code(r).await, "DENIED");

    // The robot's token grants pull only, even when push is asked.
    let robot = token(&s, "runner", &robot_token, "repository:team/app:pull,push").await;
    let claims = robot.split('.').nth(1).unwrap();
    let claims: serde_json::Value = serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(claims)
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        claims["access"],
        serde_json::json!([{"type": "repository", "name": "team/app", "actions": ["pull"]}])
    );
    let r = client()
        .post(s.url("/v2/team/app/blobs/uploads/"))
        .header("Authorization", format!("Bearer {robot}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401, "robot push");
    let r = client()
        .post(s.url("/v2/team/app/blobs/uploads/"))
        .header("Authorization", basic("runner", &robot_token))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403, "robot push with Basic");
    // The robot sees only its prefix in the catalog; bob sees both.
    for (user, secret, expect) in [
        (
            "runner",
            robot_token.as_str(),
            serde_json::json!(["team/app"]),
        ),
        (
            "bob",
            "bob-pw",
            serde_json::json!(["team/app", "team/other"]),
        ),
    ] {
        let r = client()
            .get(s.url("/v2/_catalog"))
            .header("Authorization", basic(user, secret))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["repositories"], expect, "{user}");
    }
    // And it cannot read a blob outside it.
    let d = sha256(b"blob of team/other");
    let r = client()
        .get(s.url(&format!("/v2/team/other/blobs/{d}")))
        .header("Authorization", basic("runner", &robot_token))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    // A mount from a repository the caller cannot read is a plain upload (202), not a mount.
    let r = client()
        .post(s.url(&format!(
            "/v2/team/app/blobs/uploads/?mount={d}&from=team/other"
        )))
        .header("Authorization", format!("Bearer {alice}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
}

#[tokio::test]
async fn anonymous_expired_and_tampered_requests_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (users, _) = accounts(tmp.path());
    let s = start_with_auth(&users);
    // Anonymous: every endpoint answers 401 with the Bearer challenge.
    for (method, path) in [
        ("GET", "/v2/"),
        ("GET", "/v2/_catalog"),
        ("GET", "/v2/team/app/tags/list"),
        ("HEAD", "/v2/team/app/manifests/v1"),
        ("POST", "/v2/team/app/blobs/uploads/"),
        ("GET", "/amber/v1/resolve/team/app/v1"),
        (
            "GET",
            "/amber/v1/chunks/blake3:0000000000000000000000000000000000000000000000000000000000000000",
        ),
    ] {
        let r = client()
            .request(method.parse().unwrap(), s.url(path))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401, "{method} {path}");
        let challenge = r.headers()["www-authenticate"].to_str().unwrap().to_string();
        assert!(
            challenge.starts_with(&format!(
                "Bearer realm=\"http://{}/token\",service=\"amber\"",
                s.addr
            )),
            "{challenge}"
        );
    }
    // The token endpoint itself wants credentials.
    let r = client()
        .get(s.url("/token?service=amber"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);

    // A token signed with the registry's key but expired, and one with its claims edited.
    let key = std::fs::read(s.data.join("auth/token.key")).unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let claims = |exp: u64| {
        serde_json::json!({
            "iss": "amber", "sub": "alice", "aud": "amber", "exp": exp, "nbf": exp - 600,
            "iat": exp - 600, "jti": "x",
            "access": [{"type": "repository", "name": "team/app", "actions": ["pull", "push"]}]
        })
    };
    let sign = |c: &serde_json::Value| {
        jsonwebtoken::encode(
            &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
            c,
            &jsonwebtoken::EncodingKey::from_secret(&key),
        )
        .unwrap()
    };
    let valid = sign(&claims(now + 300));
    let expired = sign(&claims(now - 60));
    let forged_key = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &claims(now + 300),
        &jsonwebtoken::EncodingKey::from_secret(b"not the registry's key, 32 bytes!"),
    )
    .unwrap();
    // The valid token's payload swapped for one naming another repository.
    let mut parts: Vec<String> = valid.split('.').map(str::to_string).collect();
    let mut edited = claims(now + 300);
    edited["access"][0]["name"] = "elsewhere".into();
    parts[1] = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .encode(serde_json::to_vec(&edited).unwrap());
    let tampered = parts.join(".");
    let check = |t: String| {
        let s = &s;
        async move {
            client()
                .get(s.url("/v2/team/app/tags/list"))
                .header("Authorization", format!("Bearer {t}"))
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    assert_eq!(
        check(valid).await,
        404,
        "a valid token reaches the API (no such repo yet)"
    );
    assert_eq!(check(expired).await, 401, "expired");
    assert_eq!(check(forged_key).await, 401, "signed with another key");
    let r = client()
        .get(s.url("/v2/elsewhere/tags/list"))
        .header("Authorization", format!("Bearer {tampered}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401, "tampered");
    assert!(error_code(r).await == "UNAUTHORIZED");

    // Failed logins: after 5 wrong passwords even the right one gets 429 for a while;
    // other accounts are unaffected.
    for _ in 0..5 {
        let r = client()
            .get(s.url("/token?service=amber"))
            .header("Authorization", basic("alice", "guess"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401);
    }
    let r = client()
        .get(s.url("/token?service=amber"))
        .header("Authorization", basic("alice", "alice-pw"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "60");
    let r = client()
        .get(s.url("/v2/"))
        .header("Authorization", basic("bob", "bob-pw"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let log = std::fs::read_to_string(s.data.join("registry.log")).unwrap();
    assert!(log.contains("failed login"), "failed logins are logged");
}

#[test]
fn bad_auth_configurations_are_refused_at_start() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_amber-registry"))
            .arg("serve")
            .arg("--data")
            .arg(&data)
            .args(args)
            .env_remove("AMBER_CONFIG")
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} started");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = run(&["--listen", "0.0.0.0:0"]);
    assert!(err.contains("without authentication"), "{err}");
    let err = run(&["--listen", "127.0.0.1:0", "--auth", "token"]);
    assert!(err.contains("needs a users file"), "{err}");
    let err = run(&["--listen", "127.0.0.1:0", "--auth", "ldap"]);
    assert!(err.contains("not one of"), "{err}");
    let users = tmp.path().join("users.toml");
    std::fs::write(
        &users,
        "[[user]]\nname = \"r\"\npassword = \"plain\"\npush = [\"x\"]\nrobot = true\n",
    )
    .unwrap();
    let err = run(&[
        "--listen",
        "127.0.0.1:0",
        "--auth",
        "token",
        "--users",
        users.to_str().unwrap(),
    ]);
    assert!(err.contains("robots are pull-only"), "{err}");
    std::fs::write(&users, "[[user]]\nname = \"a\"\npassword = \"plain\"\n").unwrap();
    let err = run(&[
        "--listen",
        "127.0.0.1:0",
        "--auth",
        "token",
        "--users",
        users.to_str().unwrap(),
    ]);
    assert!(err.contains("not an argon2 hash"), "{err}");
    // No password on standard input: nothing is written.
    let (ok, _, err) = registry_cli(
        &["user", "add", "x", "--users", users.to_str().unwrap()],
        "",
    );
    assert!(!ok && err.contains("no password"), "{err}");
    assert!(std::fs::read_to_string(&users).unwrap().contains("\"a\""));
}
