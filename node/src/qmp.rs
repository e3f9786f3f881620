//! A QEMU Machine Protocol client: one command at a time over a VM's QMP socket
//! (`-qmp unix:…`, which `vm.rs` connects once QEMU listens), JSON lines, asynchronous
//! events skipped. Enough to stop a VM, migrate it to a file, load one and continue
//! (`vm.rs`), per QEMU's docs/interop/qmp-spec.rst.

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

/// Why a QMP command did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("QMP: {0}")]
    Io(#[from] std::io::Error),
    #[error("QMP closed the connection during {0}")]
    Closed(String),
    #[error("QMP {command}: {class}: {desc}")]
    Command {
        command: String,
        class: String,
        desc: String,
    },
    #[error("QMP sent a line that is not JSON: {0}")]
    Garbled(String),
}

pub struct Qmp {
    reader: BufReader<tokio::net::unix::OwnedReadHalf>,
    writer: tokio::net::unix::OwnedWriteHalf,
}

impl Qmp {
    /// Reads the greeting on a connected QMP socket and leaves capabilities negotiation
    /// mode.
    pub async fn over(s: UnixStream) -> Result<Qmp, QmpError> {
        let (r, w) = s.into_split();
        let mut q = Qmp {
            reader: BufReader::new(r),
            writer: w,
        };
        q.line("the greeting").await?;
        q.execute("qmp_capabilities", json!({})).await?;
        Ok(q)
    }

    async fn line(&mut self, during: &str) -> Result<Value, QmpError> {
        let mut line = String::new();
        if self.reader.read_line(&mut line).await? == 0 {
            return Err(QmpError::Closed(during.to_string()));
        }
        serde_json::from_str(&line).map_err(|_| QmpError::Garbled(line.trim().to_string()))
    }

    /// Runs `command` with `arguments`; its `return` value.
    pub async fn execute(&mut self, command: &str, arguments: Value) -> Result<Value, QmpError> {
        let mut msg =
            serde_json::to_vec(&json!({"execute": command, "arguments": arguments})).expect("json");
        msg.push(b'\n');
        self.writer.write_all(&msg).await?;
        loop {
            let v = self.line(command).await?;
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                return Err(QmpError::Command {
                    command: command.to_string(),
                    class: e["class"].as_str().unwrap_or_default().to_string(),
                    desc: e["desc"].as_str().unwrap_or_default().to_string(),
                });
            }
            // An event ({"event": …}): not an answer.
        }
    }

    /// Waits (polling `query-migrate`, bounded by `limit`) until the migration this VM
    /// runs, out or in, has completed; the error QEMU gives when it failed.
    pub async fn wait_migration(&mut self, limit: std::time::Duration) -> Result<Value, QmpError> {
        let deadline = std::time::Instant::now() + limit;
        loop {
            let m = self.execute("query-migrate", json!({})).await?;
            match m["status"].as_str().unwrap_or_default() {
                "completed" => return Ok(m),
                "failed" | "cancelled" => {
                    return Err(QmpError::Command {
                        command: "migrate".into(),
                        class: m["status"].as_str().unwrap_or_default().into(),
                        desc: m["error-desc"].as_str().unwrap_or("no reason given").into(),
                    })
                }
                _ if std::time::Instant::now() > deadline => {
                    return Err(QmpError::Command {
                        command: "migrate".into(),
                        class: "timeout".into(),
                        desc: format!("not finished after {} s", limit.as_secs()),
                    })
                }
                _ => tokio::time::sleep(std::time::Duration::from_millis(10)).await,
            }
        }
    }
}
