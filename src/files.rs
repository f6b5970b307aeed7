//! Opening the files of a model directory without trusting them: symlinks are followed (the Hugging Face
//! cache is made of them), but what they resolve to must be a regular file, so a FIFO, a device such as
//! `/dev/zero` or a directory is refused before it is opened (opening a FIFO blocks until a writer comes;
//! reading `/dev/zero` never ends). Text files are read with a size limit.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};

/// Largest JSON or template file read whole: tokenizer.json of a 262,144-token vocabulary is ~32 MB.
pub const MAX_TEXT_FILE: u64 = 512 << 20;

/// What `path` is, when it is not a regular file (after following symlinks).
fn kind_of(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a named pipe (FIFO)"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// Open `path` for reading after checking that it resolves to a regular file.
pub fn open_regular(path: &Path) -> Result<File> {
    let meta = std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?;
    if !meta.is_file() {
        bail!("{} is {}, not a regular file", path.display(), kind_of(&meta));
    }
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    // The check and the open are two steps: check the file we actually got as well.
    let meta = file.metadata().with_context(|| format!("cannot read {}", path.display()))?;
    if !meta.is_file() {
        bail!("{} is {}, not a regular file", path.display(), kind_of(&meta));
    }
    Ok(file)
}

/// Whether `path` exists (following symlinks) as anything at all; a dangling symlink does not.
pub fn exists(path: &Path) -> bool {
    std::fs::metadata(path).is_ok()
}

/// Read a regular text file of at most `MAX_TEXT_FILE` bytes.
pub fn read_text(path: &Path) -> Result<String> {
    let file = open_regular(path)?;
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    if len > MAX_TEXT_FILE {
        bail!("{} is {len} bytes; text files larger than {MAX_TEXT_FILE} bytes are refused", path.display());
    }
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(MAX_TEXT_FILE + 1).read_to_end(&mut bytes).with_context(|| format!("cannot read {}", path.display()))?;
    if bytes.len() as u64 > MAX_TEXT_FILE {
        bail!("{} is larger than {MAX_TEXT_FILE} bytes; refused", path.display());
    }
    String::from_utf8(bytes).map_err(|e| {
        anyhow!("{}: not UTF-8 text (invalid byte at offset {})", path.display(), e.utf8_error().valid_up_to())
    })
}

/// Check that `dir` is a directory, with an error that says what it is instead.
pub fn require_dir(dir: &Path, what: &str) -> Result<()> {
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(m) if m.is_file() => {
            bail!(
                "{what} {} is a file, not a model directory (nor a GGUF file: it does not start with \"GGUF\")",
                dir.display()
            )
        }
        Ok(m) => bail!("{what} {} is {}, not a model directory", dir.display(), kind_of(&m)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!("{what} {} does not exist", dir.display()),
        Err(e) => bail!("{what} {}: {e}", dir.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_what_is_not_a_regular_file() {
        let e = open_regular(Path::new("/dev/zero")).unwrap_err().to_string();
        assert!(e.contains("is a device"), "{e}");
        let e = open_regular(Path::new("/tmp")).unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        let e = require_dir(Path::new("/etc/passwd"), "model directory").unwrap_err().to_string();
        assert!(e.contains("is a file, not a model directory"), "{e}");
        let e = require_dir(Path::new("/nonexistent-tandem"), "model directory").unwrap_err().to_string();
        assert!(e.contains("does not exist"), "{e}");
    }
}
