//! Headless Chromium for page tests: Debian's chromium driven over WebDriver by its
//! chromedriver (started on a loopback port, stopped when the `Browser` is dropped),
//! through fantoccini. Each browser has a fresh profile, so no cookie outlives it.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use fantoccini::elements::Element;
use fantoccini::{Client, ClientBuilder, Locator};

use crate::tools::require_tool;

pub struct Browser {
    pub client: Client,
    driver: Child,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// Starts chromedriver and a headless Chromium session.
    pub async fn start() -> Browser {
        let chromium = require_tool("chromium");
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
            l.local_addr().expect("its address").port()
        };
        let mut driver = Command::new(require_tool("chromedriver"))
            .arg(format!("--port={port}"))
            .arg("--allowed-ips=127.0.0.1")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting chromedriver");
        // chromedriver says when it listens.
        let mut out = BufReader::new(driver.stdout.take().expect("stdout"));
        let mut line = String::new();
        loop {
            line.clear();
            let n = out
                .read_line(&mut line)
                .expect("reading chromedriver's output");
            assert!(n > 0, "chromedriver exited before it listened");
            if line.contains("started successfully") {
                break;
            }
        }
        std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
        let profile = tempfile::tempdir().expect("a profile directory");
        let caps = serde_json::json!({
            "goog:chromeOptions": {
                "binary": chromium,
                "args": [
                    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                    "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    "--window-size=1280,1000",
                    format!("--user-data-dir={}", profile.path().display()),
                ],
            }
        });
        let caps = caps.as_object().expect("an object").clone();
        let client = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(caps)
            .connect(&format!("http://127.0.0.1:{port}"))
            .await
            .expect("a WebDriver session in headless Chromium");
        Browser {
            client,
            driver,
            _profile: profile,
        }
    }

    /// Ends the session (Chromium exits) and stops chromedriver.
    pub async fn close(self) {
        let _ = self.client.clone().close().await;
    }

    pub async fn goto(&self, url: &str) {
        self.client
            .goto(url)
            .await
            .unwrap_or_else(|e| panic!("opening {url}: {e}"));
    }

    pub async fn find(&self, css: &str) -> Element {
        match self.client.find(Locator::Css(css)).await {
            Ok(e) => e,
            Err(e) => panic!("no element {css:?} on {}: {e}", self.url().await),
        }
    }

    pub async fn find_all(&self, css: &str) -> Vec<Element> {
        self.client
            .find_all(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("finding {css:?}: {e}"))
    }

    /// The text of the element `css` selects.
    pub async fn text(&self, css: &str) -> String {
        self.find(css)
            .await
            .text()
            .await
            .unwrap_or_else(|e| panic!("text of {css:?}: {e}"))
    }

    pub async fn fill(&self, css: &str, value: &str) {
        let e = self.find(css).await;
        e.clear().await.expect("clearing a field");
        e.send_keys(value).await.expect("typing into a field");
    }

    pub async fn click(&self, css: &str) {
        self.find(css)
            .await
            .click()
            .await
            .unwrap_or_else(|e| panic!("clicking {css:?}: {e}"));
    }

    /// Clicks a link or submit button and waits until the page it leads to has loaded: a
    /// click returns before the navigation it starts, so without this a read after it
    /// can see the old page (or elements that go stale under it). The old document is
    /// marked; the new one is the first loaded document without the mark.
    pub async fn follow(&self, css: &str) {
        assert_eq!(
            self.script("window.__amberOldPage = true; return true")
                .await,
            serde_json::Value::Bool(true),
            "marking the page before clicking {css:?}"
        );
        self.click(css).await;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let loaded = self
                .script("return window.__amberOldPage === undefined && document.readyState === 'complete'")
                .await;
            if loaded == serde_json::Value::Bool(true) {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "clicking {css:?} on {} loaded no new page within 60 s",
                self.url().await
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// Runs `js` in the page; a script that runs while the page is being replaced answers
    /// null.
    async fn script(&self, js: &str) -> serde_json::Value {
        self.client
            .execute(js, Vec::new())
            .await
            .unwrap_or(serde_json::Value::Null)
    }

    pub async fn url(&self) -> String {
        self.client
            .current_url()
            .await
            .map(|u| u.to_string())
            .unwrap_or_default()
    }

    /// The page's text as shown.
    pub async fn page_text(&self) -> String {
        self.text("body").await
    }

    /// A PNG of the viewport, written to `path`.
    pub async fn screenshot(&self, path: &Path) -> PathBuf {
        let png = self.client.screenshot().await.expect("a screenshot");
        std::fs::write(path, png).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        path.to_path_buf()
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}
