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
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag};

use crate::manifest::ImageSource;
use crate::pipeline::{Fetch, FetchError};

/// The default limit on one image file or object: generous for any photo or scan a
/// vision-language model is trained on, far below what would exhaust a node.
pub const DEFAULT_MAX_IMAGE_BYTES: u64 = 256 << 20;

/// Opens `path` for reading without blocking on a FIFO or a device, and refuses anything but
/// a regular file, saying what it is.
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags((OFlag::O_NONBLOCK | OFlag::O_NOCTTY).bits())
        .open(path)?;
    check_regular(&file, path)?;
    Ok(file)
}

/// Refuses `file` unless it is a regular file.
fn check_regular(file: &File, path: &Path) -> std::io::Result<std::fs::Metadata> {
    let meta = file.metadata()?;
    let kind = meta.file_type();
    let what = if kind.is_file() {
        return Ok(meta);
    } else if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    };
    Err(std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        format!("{} is {what}, not a regular file", path.display()),
    ))
}

/// Reads all of `file` (opened by [`open_regular`] or the like) if it holds at most `max`
/// bytes: the size is checked before reading and again while reading.
fn read_bounded(file: File, path: &Path, max: u64) -> Result<Vec<u8>, FetchError> {
    let too_large = |size: String| {
        FetchError::TooLarge(format!(
            "{} is {size} bytes, over the {max}-byte limit (--max-image-bytes)",
            path.display()
        ))
    };
    let meta = check_regular(&file, path).map_err(|e| FetchError::Invalid(e.to_string()))?;
    if meta.len() > max {
        return Err(too_large(meta.len().to_string()));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(max + 1)
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
        _ => FetchError::Other(format!("{}: {e}", path.display())),
    }
}

/// The folder image paths must stay beneath.
#[derive(Debug)]
struct Root {
    /// As given (absolute): image paths are matched against it by their components.
    path: PathBuf,
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
    /// Files anywhere this process may read, up to [`DEFAULT_MAX_IMAGE_BYTES`] each: for
    /// manifests the caller trusts (the `feedstore` command confines images with
    /// [`LocalFiles::beneath`]).
    fn default() -> Self {
        LocalFiles::anywhere(DEFAULT_MAX_IMAGE_BYTES)
    }
}

impl LocalFiles {
    /// Files anywhere this process may read, up to `max_bytes` each.
    pub fn anywhere(max_bytes: u64) -> LocalFiles {
        LocalFiles {
            root: None,
            max_bytes,
        }
    }

    /// Files beneath `root` only (no `..`, no symbolic link leads out), up to `max_bytes` each.
    /// With `absolute_anywhere`, an absolute path outside `root` is read as given (the user
    /// allows absolute paths); relative paths stay confined either way.
    pub fn beneath(
        root: &Path,
        absolute_anywhere: bool,
        max_bytes: u64,
    ) -> std::io::Result<LocalFiles> {
        let path = std::path::absolute(root)?;
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
        Ok(LocalFiles {
            root: Some(Arc::new(Root {
                path,
                dir,
                absolute_anywhere,
            })),
            max_bytes,
        })
    }

    /// The largest file read.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Opens `path` as this reader's rules allow.
    fn open(&self, path: &Path) -> Result<File, FetchError> {
        let Some(root) = &self.root else {
            return open_regular(path).map_err(|e| match e.kind() {
                std::io::ErrorKind::InvalidInput => FetchError::Invalid(e.to_string()),
                _ => io_error(path, e),
            });
        };
        let absolute = std::path::absolute(path).map_err(|e| io_error(path, e))?;
        let Ok(inside) = absolute.strip_prefix(&root.path) else {
            if root.absolute_anywhere && path.is_absolute() {
                return LocalFiles::anywhere(self.max_bytes).open(path);
            }
            return Err(FetchError::Invalid(format!(
                "{} is outside the image root {} (set --image-root, or allow absolute paths \
                 with --allow-absolute-image-paths)",
                path.display(),
                root.path.display()
            )));
        };
        let how = OpenHow::new()
            .flags(OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_NOCTTY | OFlag::O_CLOEXEC)
            .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_MAGICLINKS);
        let target = if inside.as_os_str().is_empty() {
            Path::new(".")
        } else {
            inside
        };
        match nix::fcntl::openat2(&root.dir, target, how) {
            Ok(fd) => Ok(File::from(fd)),
            Err(Errno::EXDEV) => Err(FetchError::Invalid(format!(
                "{} leads out of the image root {} (through .. or a symbolic link)",
                path.display(),
                root.path.display()
            ))),
            Err(e) => Err(io_error(path, e.into())),
        }
    }

    /// Reads the file at `path`: a regular file of at most the limit, as this reader allows.
    pub fn read(&self, path: &Path) -> Result<Vec<u8>, FetchError> {
        let file = self.open(path)?;
        read_bounded(file, path, self.max_bytes)
    }
}

impl Fetch for LocalFiles {
    fn fetch<'a>(
        &'a self,
        source: &'a ImageSource,
    ) -> Pin<Box<dyn Future<Output = Result<Bytes, FetchError>> + Send + 'a>> {
        Box::pin(async move {
            let ImageSource::Local(path) = source else {
                return Err(FetchError::Unsupported(format!(
                    "{source} (no S3 endpoint configured)"
                )));
            };
            let (files, path) = (self.clone(), path.clone());
            tokio::task::spawn_blocking(move || files.read(&path).map(Bytes::from))
                .await
                .map_err(|e| FetchError::Other(format!("reading {}: {e}", source)))?
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
        assert_eq!(files.read(&dir.join("images/ok.png")).unwrap(), b"12345678");
        // A FIFO with no writer: refused at once instead of waiting for one forever.
        let err = files.read(&fifo).unwrap_err().to_string();
        assert!(err.contains("is a FIFO, not a regular file"), "{err}");
        let err = files.read(&dir.join("images")).unwrap_err().to_string();
        assert!(err.contains("is a directory"), "{err}");
        let err = files.read(Path::new("/dev/zero")).unwrap_err().to_string();
        assert!(err.contains("is a character device"), "{err}");
        let err = LocalFiles::anywhere(7)
            .read(&dir.join("images/ok.png"))
            .unwrap_err();
        assert!(
            matches!(&err, FetchError::TooLarge(m) if m.contains("8 bytes, over the 7-byte limit")),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn image_paths_stay_beneath_the_root() {
        let dir = scratch("root");
        std::fs::write(dir.join("images/ok.png"), b"png").unwrap();
        std::fs::create_dir(dir.join("images/sub")).unwrap();
        std::fs::write(dir.join("secret"), b"outside").unwrap();
        std::os::unix::fs::symlink(dir.join("secret"), dir.join("images/link.png")).unwrap();
        std::os::unix::fs::symlink("../secret", dir.join("images/rel-link.png")).unwrap();
        let root = dir.join("images");
        let files = LocalFiles::beneath(&root, false, 1 << 20).unwrap();
        assert_eq!(files.read(&root.join("ok.png")).unwrap(), b"png");
        assert_eq!(files.read(&root.join("sub/../ok.png")).unwrap(), b"png");
        for escape in [
            root.join("../secret"),
            root.join("../../../../../../etc/passwd"),
            root.join("link.png"),
            root.join("rel-link.png"),
        ] {
            let err = files.read(&escape).unwrap_err().to_string();
            assert!(
                err.contains("leads out of the image root"),
                "{escape:?}: {err}"
            );
        }
        let err = files
            .read(Path::new("/etc/passwd"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("outside the image root"), "{err}");
        // Allowing absolute paths reads them as given; relative ones stay confined.
        let open = LocalFiles::beneath(&root, true, 1 << 20).unwrap();
        assert_eq!(open.read(&dir.join("secret")).unwrap(), b"outside");
        assert!(open.read(&root.join("../secret")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
