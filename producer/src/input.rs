//! Inputs a producer reads from the node's file system: regular files only, of bounded size,
//! and image paths kept beneath a root.
//!
//! A manifest names its images, so whoever writes the manifest chooses what the producer opens.
//! Every open here is non-blocking (a FIFO does not hang it), checked with `fstat` on the open
//! descriptor (so a path swapped after a check is not read), refused unless it is a regular file,
//! and read with the size limit checked before and while reading (a file that grows, or
//! `/dev/zero`, stops at the limit). [`LocalFiles::beneath`] resolves image paths with
//! `openat2(RESOLVE_BENEATH)` from the root's descriptor, so neither `..` nor a symbolic link
//! leads out of it.

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag};

use crate::source::{Fetch, FetchError, Fetching, ImageSource};

/// The default limit on one image file or object: generous for any photo or scan a
/// vision-language model is trained on. Memory held by images at once is bounded by this times
/// the images in flight (`--fetch-concurrency` plus about three per CPU worker).
pub const DEFAULT_MAX_IMAGE_BYTES: u64 = 64 << 20;

/// The largest `max_bytes` a reader takes (1 TiB): beyond it the setting is surely a mistake.
pub const MAX_IMAGE_BYTES_LIMIT: u64 = 1 << 40;

/// Opens `path` for reading as [`open_beneath`] does, without a root: symbolic links are
/// followed, but nothing but a regular file is ever opened for reading (a device's driver never
/// runs, a FIFO never blocks).
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    open_checked(None, path).map(|(file, _)| file)
}

/// The text of the regular file at `path` (a list of shards, a checkpoint's states), refused
/// past `max` bytes without reading more, or when it is not UTF-8; `what` names it in errors.
pub fn read_text(path: &Path, max: u64, what: &str) -> Result<String, String> {
    let mut bytes = Vec::new();
    open_regular(path)
        .and_then(|f| f.take(max + 1).read_to_end(&mut bytes))
        .map_err(|e| format!("reading {what} {}: {e}", path.display()))?;
    if bytes.len() as u64 > max {
        return Err(format!(
            "{what} {} is over {} MiB",
            path.display(),
            max >> 20
        ));
    }
    String::from_utf8(bytes).map_err(|_| format!("{what} {} is not text", path.display()))
}

/// Opens `path` (beneath `dir` when given: no `..`, absolute or magic link leads out) first as an
/// `O_PATH` descriptor, which only names the file; refuses it, saying what it is, unless `fstat`
/// says it is a regular file; and only then opens that same file for reading, through
/// `/proc/self/fd` (where `/proc` is missing, by a second non-blocking open of the path).
/// Returns it with its size.
fn open_checked(dir: Option<&OwnedFd>, path: &Path) -> std::io::Result<(File, u64)> {
    let named = retry_eagain(|| match dir {
        Some(dir) => nix::fcntl::openat2(
            dir,
            path,
            OpenHow::new()
                .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
                .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_MAGICLINKS),
        ),
        None => nix::fcntl::open(
            path,
            OFlag::O_PATH | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        ),
    })?;
    let stat = nix::sys::stat::fstat(&named)?;
    check_kind(stat.st_mode, path)?;
    let flags = OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_NOCTTY | OFlag::O_CLOEXEC;
    let proc_path = format!("/proc/self/fd/{}", named.as_raw_fd());
    let file = match nix::fcntl::open(proc_path.as_str(), flags, nix::sys::stat::Mode::empty()) {
        Ok(fd) => File::from(fd),
        Err(Errno::ENOENT) => {
            let fd = match dir {
                Some(dir) => nix::fcntl::openat2(
                    dir,
                    path,
                    OpenHow::new()
                        .flags(flags)
                        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_MAGICLINKS),
                )?,
                None => nix::fcntl::open(path, flags, nix::sys::stat::Mode::empty())?,
            };
            File::from(fd)
        }
        Err(e) => return Err(e.into()),
    };
    // The same file as the one checked (a path swapped in between is refused).
    let again = file.metadata()?;
    if (again.dev(), again.ino()) != (stat.st_dev, stat.st_ino) {
        return Err(std::io::Error::other(format!(
            "{} changed while it was opened",
            path.display()
        )));
    }
    Ok((file, again.len()))
}

/// `open` again while it fails with `EAGAIN` (a rename racing `openat2`'s `..` check), a few
/// times.
fn retry_eagain(mut open: impl FnMut() -> nix::Result<OwnedFd>) -> nix::Result<OwnedFd> {
    let mut tries = 0;
    loop {
        match open() {
            Err(Errno::EAGAIN) if tries < 8 => tries += 1,
            other => return other,
        }
    }
}

/// Refuses a file mode unless it is a regular file's, saying what it is.
fn check_kind(mode: nix::libc::mode_t, path: &Path) -> std::io::Result<()> {
    let what = match mode & nix::libc::S_IFMT {
        nix::libc::S_IFREG => return Ok(()),
        nix::libc::S_IFDIR => "a directory",
        nix::libc::S_IFIFO => "a FIFO",
        nix::libc::S_IFCHR => "a character device",
        nix::libc::S_IFBLK => "a block device",
        nix::libc::S_IFSOCK => "a socket",
        _ => "not a regular file",
    };
    Err(std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        format!("{} is {what}, not a regular file", path.display()),
    ))
}

/// Reads all of `file` (a regular file of `len` bytes when opened) if it holds at most `max`
/// bytes: the size is checked before reading and again while reading.
fn read_bounded(file: File, len: u64, path: &Path, max: u64) -> Result<Vec<u8>, FetchError> {
    let too_large = |size: String| {
        FetchError::TooLarge(format!(
            "{} is {size} bytes, over the {max}-byte limit (--max-image-bytes)",
            path.display()
        ))
    };
    if len > max {
        return Err(too_large(len.to_string()));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(max.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| io_error(path, e))?;
    if bytes.len() as u64 > max {
        return Err(too_large("more than that (it grew while read)".into()));
    }
    Ok(bytes)
}

fn io_error(path: &Path, e: std::io::Error) -> FetchError {
    match e.kind() {
        std::io::ErrorKind::NotFound => FetchError::NotFound(path.display().to_string()),
        std::io::ErrorKind::PermissionDenied => {
            FetchError::AccessDenied(path.display().to_string())
        }
        std::io::ErrorKind::InvalidInput => FetchError::Invalid(e.to_string()),
        _ => FetchError::Other(format!("{}: {e}", path.display())),
    }
}

/// The folder image paths must stay beneath.
#[derive(Debug)]
struct Root {
    /// As given, made absolute: where relative paths resolve, and shown in messages.
    path: PathBuf,
    /// Its canonical spelling: an absolute image path beneath either spelling is inside.
    canonical: PathBuf,
    /// An `O_PATH` descriptor the paths are resolved from.
    dir: OwnedFd,
    /// Absolute image paths elsewhere are read as given.
    absolute_anywhere: bool,
}

/// Reads image files, regular ones of at most `max_bytes`, beneath a root folder or anywhere.
#[derive(Debug, Clone)]
pub struct LocalFiles {
    root: Option<Arc<Root>>,
    max_bytes: u64,
}

impl Default for LocalFiles {
    /// Files anywhere this process may read, relative paths against their manifest's folder, up
    /// to [`DEFAULT_MAX_IMAGE_BYTES`] each: for manifests the caller trusts (the `feedstore`
    /// command confines images with [`LocalFiles::beneath`]).
    fn default() -> Self {
        LocalFiles::anywhere(DEFAULT_MAX_IMAGE_BYTES)
    }
}

impl LocalFiles {
    /// Files anywhere this process may read (relative paths against their manifest's folder),
    /// up to `max_bytes` each.
    pub fn anywhere(max_bytes: u64) -> LocalFiles {
        LocalFiles {
            root: None,
            max_bytes: max_bytes.min(MAX_IMAGE_BYTES_LIMIT),
        }
    }

    /// Files beneath `root` only, up to `max_bytes` each: relative image paths resolve against
    /// `root` (not their manifest's folder), absolute ones must lie beneath it, and neither `..`
    /// nor a symbolic link (an absolute one at all) leads out. With `absolute_anywhere`, an
    /// absolute path outside `root` is read as given (the user allows absolute paths); relative
    /// paths stay confined either way. Fails, saying why, where the kernel (or a container's
    /// seccomp profile) lacks `openat2`.
    pub fn beneath(
        root: &Path,
        absolute_anywhere: bool,
        max_bytes: u64,
    ) -> std::io::Result<LocalFiles> {
        let path = std::path::absolute(root)?;
        let canonical = std::fs::canonicalize(&path).map_err(|e| {
            std::io::Error::new(e.kind(), format!("image root {}: {e}", path.display()))
        })?;
        let dir = nix::fcntl::open(
            &path,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .map_err(|e| {
            std::io::Error::new(
                std::io::Error::from(e).kind(),
                format!("image root {}: {}", path.display(), e.desc()),
            )
        })?;
        let how = OpenHow::new()
            .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
            .resolve(ResolveFlag::RESOLVE_BENEATH);
        if let Err(e @ (Errno::ENOSYS | Errno::EPERM)) = nix::fcntl::openat2(&dir, ".", how) {
            return Err(std::io::Error::other(format!(
                "confining image paths needs openat2 (Linux 5.6 or later, allowed by the \
                 container's seccomp profile): {}",
                e.desc()
            )));
        }
        Ok(LocalFiles {
            root: Some(Arc::new(Root {
                path,
                canonical,
                dir,
                absolute_anywhere,
            })),
            max_bytes: max_bytes.min(MAX_IMAGE_BYTES_LIMIT),
        })
    }

    /// The largest file read.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// The image root, if paths are confined.
    pub fn root(&self) -> Option<&Path> {
        self.root.as_ref().map(|r| r.path.as_path())
    }

    /// Reads the image at `path` (as written in a manifest whose folder is `base`): a regular
    /// file of at most the limit, opened as this reader's rules allow.
    pub fn read(&self, base: &Path, path: &Path) -> Result<Vec<u8>, FetchError> {
        // Where to resolve from (a root's descriptor, or anywhere), what, and what to call it.
        let (dir, target, shown) = match &self.root {
            None => (None, base.join(path), base.join(path)),
            Some(root) => {
                let inside = if path.is_relative() {
                    Some(path)
                } else {
                    [&root.canonical, &root.path]
                        .iter()
                        .find_map(|r| path.strip_prefix(r).ok())
                };
                match inside {
                    Some(inside) if inside.as_os_str().is_empty() => {
                        (Some(&root.dir), PathBuf::from("."), root.path.clone())
                    }
                    Some(inside) => (
                        Some(&root.dir),
                        inside.to_path_buf(),
                        root.path.join(inside),
                    ),
                    None if root.absolute_anywhere => {
                        (None, path.to_path_buf(), path.to_path_buf())
                    }
                    None => {
                        return Err(FetchError::Invalid(format!(
                            "{} is outside the image root {} (set --image-root, or allow \
                             absolute paths with --allow-absolute-image-paths)",
                            path.display(),
                            root.path.display()
                        )));
                    }
                }
            }
        };
        let (file, len) = open_checked(dir, &target).map_err(|e| match e.raw_os_error() {
            Some(code) if code == Errno::EXDEV as i32 => FetchError::Invalid(format!(
                "{} leads out of the image root {} (through .., a symbolic link out, or an absolute symbolic link, which is refused even when it points inside)",
                shown.display(),
                self.root().map_or(Path::new("/"), |r| r).display()
            )),
            _ => io_error(&shown, e),
        })?;
        read_bounded(file, len, &shown, self.max_bytes)
    }
}

impl Fetch for LocalFiles {
    fn fetch<'a>(&'a self, source: &'a ImageSource) -> Fetching<'a, Bytes> {
        Box::pin(async move {
            let (base, path) = match source {
                ImageSource::Local { base, path } => (base, path),
                ImageSource::S3 { .. } => {
                    return Err(FetchError::Unsupported(format!(
                        "{source} (no S3 endpoint configured)"
                    )));
                }
                ImageSource::Member { .. } => {
                    return Err(FetchError::Unsupported(format!(
                        "{source} (a shard's member is read with its shard)"
                    )));
                }
            };
            let (files, base, path) = (self.clone(), base.clone(), path.clone());
            tokio::task::spawn_blocking(move || files.read(&base, &path).map(Bytes::from))
                .await
                .map_err(|e| FetchError::Other(format!("reading {source}: {e}")))?
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("feedstore-input-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("images")).unwrap();
        dir
    }

    #[test]
    fn only_regular_files_of_bounded_size_are_read() {
        let dir = scratch("kinds");
        std::fs::write(dir.join("images/ok.png"), b"12345678").unwrap();
        let fifo = dir.join("images/fifo.png");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let files = LocalFiles::anywhere(8);
        let read = |files: &LocalFiles, path: &str| files.read(&dir, Path::new(path));
        assert_eq!(read(&files, "images/ok.png").unwrap(), b"12345678");
        // A FIFO with no writer: refused at once instead of waiting for one forever.
        let err = read(&files, "images/fifo.png").unwrap_err().to_string();
        assert!(err.contains("is a FIFO, not a regular file"), "{err}");
        let err = read(&files, "images").unwrap_err().to_string();
        assert!(err.contains("is a directory"), "{err}");
        // A device is refused from its O_PATH descriptor: its driver is never opened.
        let err = read(&files, "/dev/zero").unwrap_err().to_string();
        assert!(err.contains("is a character device"), "{err}");
        let err = read(&LocalFiles::anywhere(7), "images/ok.png").unwrap_err();
        assert!(
            matches!(&err, FetchError::TooLarge(m) if m.contains("8 bytes, over the 7-byte limit")),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn image_paths_stay_beneath_the_root() {
        let dir = scratch("root");
        let root = dir.join("images");
        std::fs::write(root.join("ok.png"), b"png").unwrap();
        std::fs::create_dir(root.join("sub")).unwrap();
        std::fs::write(dir.join("secret"), b"outside").unwrap();
        std::os::unix::fs::symlink(dir.join("secret"), root.join("link.png")).unwrap();
        std::os::unix::fs::symlink("../secret", root.join("rel-link.png")).unwrap();
        // The manifest lives elsewhere: relative paths resolve against the root, not its folder.
        let manifests = dir.join("manifests");
        for absolute_anywhere in [false, true] {
            let files = LocalFiles::beneath(&root, absolute_anywhere, 1 << 20).unwrap();
            let read = |path: &Path| files.read(&manifests, path);
            assert_eq!(read(Path::new("ok.png")).unwrap(), b"png");
            assert_eq!(read(Path::new("sub/../ok.png")).unwrap(), b"png");
            assert_eq!(read(&root.join("ok.png")).unwrap(), b"png");
            // Relative paths stay confined whatever absolute paths may do.
            for escape in [
                "../secret",
                "../../../../../../etc/passwd",
                "sub/../../secret",
                "link.png",
                "rel-link.png",
            ]
            .map(Path::new)
            {
                let err = read(escape).unwrap_err().to_string();
                assert!(
                    err.contains("leads out of the image root"),
                    "{escape:?}: {err}"
                );
            }
            let err = read(&root.join("link.png")).unwrap_err().to_string();
            assert!(err.contains("leads out of the image root"), "{err}");
            let outside = read(&dir.join("secret"));
            if absolute_anywhere {
                assert_eq!(outside.unwrap(), b"outside");
            } else {
                let err = outside.unwrap_err().to_string();
                assert!(err.contains("outside the image root"), "{err}");
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
