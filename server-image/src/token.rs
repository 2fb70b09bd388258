//! The admin bearer token and where it comes from: a file that is re-read
//! when it changes ([`c10m_wire::env::ADMIN_TOKEN_FILE`]), a fixed value
//! ([`c10m_wire::env::ADMIN_TOKEN`]), or none.
//!
//! The operator mounts the fleet's admin Secret as a volume and names the
//! file ([`c10m_wire::admin::TOKEN_PATH`]). The kubelet updates a Secret
//! volume by writing a new timestamped directory and swapping the `..data`
//! symlink to it in one `rename(2)`; `token` is a symlink to
//! `..data/token`, so opening the path always gives the old or the new file,
//! whole. The server re-reads the file when an order needs it, at most once
//! per [`RELOAD_INTERVAL`]: a rotated Secret takes effect within the
//! kubelet's sync period plus that second, without a restart, and the old
//! token stops working at the same moment. Nothing is read for probes or
//! scrapes, and no thread or timer is spent on it.
//!
//! A file that cannot give a token (gone, unreadable, not a regular file,
//! empty, larger than [`MAX_TOKEN_BYTES`], not UTF-8) fails closed: orders
//! are refused with 503 ([`Verdict::Unavailable`]) until it gives one
//! again, never accepted; the change is logged once each way. At start the
//! file must be readable (an unreadable one stops the server, naming it):
//! that is a mount or permission mistake, best seen before serving.

use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use crate::admin::authorized;

/// Least time between two reads of the token file: orders arriving faster
/// are checked against the token read last. Bounds the file reads an
/// attacker can cause with bad orders to one per second, and the time a
/// rotated token takes to be seen to one second more than the kubelet's.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(1);

/// Largest token file read, in bytes; a larger one gives no token. The
/// operator's tokens are 64 hex digits.
pub const MAX_TOKEN_BYTES: u64 = 4096;

/// What the admin port does with an order's `Authorization` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// It carries the token: carry the order out.
    Allowed,
    /// It does not, or no token is configured at all: 401.
    Denied,
    /// A token file is configured but gives no token now: 503, whatever
    /// the header says.
    Unavailable,
}

/// Reads a token file once: the token as [`c10m_wire::admin::token`]
/// defines it (surrounding whitespace trimmed, visible ASCII), `Ok(None)`
/// if nothing is left. Opened non-blocking (a FIFO at the path cannot hang the
/// admin thread), refused unless it is a regular file of at most
/// [`MAX_TOKEN_BYTES`] bytes in UTF-8.
pub fn read_token_file(path: &Path) -> io::Result<Option<String>> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    let mut bytes = Vec::new();
    file.take(MAX_TOKEN_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_TOKEN_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("larger than {MAX_TOKEN_BYTES} bytes"),
        ));
    }
    let text = String::from_utf8(bytes)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "not UTF-8"))?;
    c10m_wire::admin::token(&text)
        .map(|t| t.map(str::to_string))
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Where an [`AdminToken`] comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenSource {
    /// Nowhere: orders are refused.
    None,
    /// A value fixed at start ([`c10m_wire::env::ADMIN_TOKEN`]).
    Fixed,
    /// A file, re-read as it changes ([`c10m_wire::env::ADMIN_TOKEN_FILE`]).
    File,
}

/// The token orders are checked against.
#[derive(Debug)]
pub struct AdminToken(Inner);

#[derive(Debug)]
enum Inner {
    None,
    Fixed(String),
    File(Mutex<FileToken>),
}

/// A token file and what it gave when it was read last.
#[derive(Debug)]
struct FileToken {
    path: PathBuf,
    /// The token, or why there is none.
    current: Result<String, String>,
    /// When the file was read last.
    read_at: Instant,
}

impl FileToken {
    fn read(path: &Path) -> Result<String, String> {
        match read_token_file(path) {
            Ok(Some(t)) => Ok(t),
            Ok(None) => Err("the file is empty".into()),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Re-reads the file if [`RELOAD_INTERVAL`] has passed since the last
    /// read, logging each change of state once.
    fn refresh(&mut self, now: Instant) {
        if now.saturating_duration_since(self.read_at) < RELOAD_INTERVAL {
            return;
        }
        self.read_at = now;
        let next = Self::read(&self.path);
        let path = self.path.display();
        match (&self.current, &next) {
            (Ok(old), Ok(new)) if old != new => {
                tracing::info!(%path, "admin token changed: orders need the new one")
            }
            (Ok(_), Err(why)) => tracing::warn!(
                %path, error = %why,
                "admin token file gives no token: POST /drain and /shed answer 503 until it does"
            ),
            (Err(_), Ok(_)) => tracing::info!(%path, "admin token file readable again"),
            _ => {}
        }
        self.current = next;
    }
}

impl AdminToken {
    /// No token: every order is refused (401).
    pub fn none() -> Self {
        AdminToken(Inner::None)
    }

    /// A token fixed for the life of the process; blank counts as none.
    pub fn fixed(token: &str) -> Self {
        match c10m_wire::admin::token(token) {
            Ok(Some(t)) => AdminToken(Inner::Fixed(t.to_string())),
            Ok(None) | Err(_) => Self::none(),
        }
    }

    /// A token file, read now: an error if it cannot be read (opened,
    /// read, a regular file of UTF-8 within the size cap). An empty file
    /// is not an error: orders answer 503 until the file holds a token.
    pub fn file(path: &Path) -> io::Result<Self> {
        let current = read_token_file(path)?.ok_or_else(|| "the file is empty".to_string());
        if let Err(why) = &current {
            tracing::warn!(
                path = %path.display(), error = %why,
                "admin token file gives no token: POST /drain and /shed answer 503 until it does"
            );
        }
        Ok(AdminToken(Inner::File(Mutex::new(FileToken {
            path: path.to_path_buf(),
            current,
            read_at: Instant::now(),
        }))))
    }

    /// From the configuration: the file if one is named, else the fixed
    /// token, else none. A fixed token that is no token
    /// ([`c10m_wire::admin::token`]) is an error, not a silent "none".
    pub fn from_config(config: &crate::Config) -> io::Result<Self> {
        match (&config.admin_token_file, &config.admin_token) {
            (Some(path), _) => Self::file(path),
            (None, Some(token)) => c10m_wire::admin::token(token)
                .map(|_| Self::fixed(token))
                .map_err(|e| {
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("{}: {e}", c10m_wire::env::ADMIN_TOKEN),
                    )
                }),
            (None, None) => Ok(Self::none()),
        }
    }

    /// Where the token comes from.
    pub fn source(&self) -> TokenSource {
        match self.0 {
            Inner::None => TokenSource::None,
            Inner::Fixed(_) => TokenSource::Fixed,
            Inner::File(_) => TokenSource::File,
        }
    }

    /// Checks an order's `Authorization` header now.
    pub fn check(&self, authorization: Option<&str>) -> Verdict {
        self.check_at(authorization, Instant::now())
    }

    /// [`AdminToken::check`] at `now` (the file is re-read if
    /// [`RELOAD_INTERVAL`] has passed since its last read).
    pub fn check_at(&self, authorization: Option<&str>, now: Instant) -> Verdict {
        let allowed = |token| {
            if authorized(authorization, Some(token)) {
                Verdict::Allowed
            } else {
                Verdict::Denied
            }
        };
        match &self.0 {
            Inner::None => Verdict::Denied,
            Inner::Fixed(t) => allowed(t),
            Inner::File(file) => {
                let mut file = file.lock().unwrap_or_else(|e| e.into_inner());
                file.refresh(now);
                match &file.current {
                    Ok(t) => allowed(t),
                    Err(_) => Verdict::Unavailable,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Dir(PathBuf);

    impl Dir {
        fn new(name: &str) -> Dir {
            let d = std::env::temp_dir().join(format!("c10m-token-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).unwrap();
            Dir(d)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    const SEC: Duration = Duration::from_secs(1);

    #[test]
    fn bearer_compare() {
        assert!(authorized(Some("Bearer tok"), Some("tok")));
        assert!(authorized(Some(" bearer  tok "), Some("tok")));
        assert!(!authorized(Some("Bearer tok"), None));
        assert!(!authorized(None, Some("tok")));
        assert!(!authorized(Some("Basic tok"), Some("tok")));
        assert!(!authorized(Some("Bearer"), Some("tok")));
        assert!(!authorized(Some("Bearer toke"), Some("tok")));
    }

    #[test]
    fn fixed_and_none() {
        assert_eq!(AdminToken::none().check(Some("Bearer x")), Verdict::Denied);
        assert_eq!(
            AdminToken::fixed("  ").check(Some("Bearer ")),
            Verdict::Denied
        );
        let t = AdminToken::fixed(" tok\n");
        assert_eq!(t.check(Some("Bearer tok")), Verdict::Allowed);
        assert_eq!(t.check(Some("Bearer nope")), Verdict::Denied);
        assert_eq!(t.check(None), Verdict::Denied);
        assert_eq!(t.source(), TokenSource::Fixed);
    }

    #[test]
    fn a_changed_file_is_seen_after_the_reload_interval_only() {
        let d = Dir::new("change");
        let path = d.0.join("token");
        std::fs::write(&path, "old\n").unwrap();
        let t = AdminToken::file(&path).unwrap();
        let t0 = Instant::now();
        assert_eq!(t.check_at(Some("Bearer old"), t0), Verdict::Allowed);
        std::fs::write(&path, "new").unwrap();
        // Within the interval the last read stands.
        assert_eq!(t.check_at(Some("Bearer old"), t0), Verdict::Allowed);
        assert_eq!(t.check_at(Some("Bearer new"), t0), Verdict::Denied);
        // After it, the file is read again: the old token is refused.
        let t1 = t0 + SEC;
        assert_eq!(t.check_at(Some("Bearer old"), t1), Verdict::Denied);
        assert_eq!(t.check_at(Some("Bearer new"), t1), Verdict::Allowed);
    }

    #[test]
    fn a_file_that_gives_no_token_fails_closed_and_recovers() {
        let d = Dir::new("closed");
        let path = d.0.join("token");
        std::fs::write(&path, "tok").unwrap();
        let t = AdminToken::file(&path).unwrap();
        let mut now = Instant::now();
        let mut at = |s: &str| {
            now += SEC;
            std::fs::write(&path, s).unwrap();
            t.check_at(Some("Bearer tok"), now)
        };
        assert_eq!(at("tok"), Verdict::Allowed);
        assert_eq!(at(""), Verdict::Unavailable, "empty");
        assert_eq!(at(" \n"), Verdict::Unavailable, "blank");
        let big = "t".repeat(MAX_TOKEN_BYTES as usize + 1);
        assert_eq!(at(&big), Verdict::Unavailable, "too large");
        assert_eq!(at("tok"), Verdict::Allowed, "back");
        std::fs::remove_file(&path).unwrap();
        now += SEC;
        assert_eq!(t.check_at(Some("Bearer tok"), now), Verdict::Unavailable);
        assert_eq!(t.check_at(None, now), Verdict::Unavailable);
        // A directory where the file was is no token either.
        std::fs::create_dir(&path).unwrap();
        now += SEC;
        assert_eq!(t.check_at(Some("Bearer tok"), now), Verdict::Unavailable);
        std::fs::remove_dir(&path).unwrap();
        std::fs::write(&path, [0xff, 0xfe]).unwrap();
        now += SEC;
        assert_eq!(t.check_at(Some("Bearer tok"), now), Verdict::Unavailable);
    }

    #[test]
    fn at_start_an_unreadable_file_is_an_error_and_an_empty_one_is_not() {
        let d = Dir::new("start");
        let path = d.0.join("token");
        assert!(AdminToken::file(&path).is_err(), "missing");
        std::fs::write(&path, "").unwrap();
        let t = AdminToken::file(&path).unwrap();
        assert_eq!(t.check(Some("Bearer ")), Verdict::Unavailable);
        assert_eq!(t.source(), TokenSource::File);
        assert_eq!(read_token_file(&path).unwrap(), None);
        std::fs::write(&path, " s3cret \n").unwrap();
        assert_eq!(read_token_file(&path).unwrap().as_deref(), Some("s3cret"));
        assert!(read_token_file(&d.0).is_err(), "a directory");
    }

    #[test]
    fn a_fifo_does_not_block() {
        let d = Dir::new("fifo");
        let path = d.0.join("token");
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            &path,
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .unwrap();
        let started = Instant::now();
        assert!(read_token_file(&path).is_err());
        assert!(started.elapsed() < SEC);
    }
}
