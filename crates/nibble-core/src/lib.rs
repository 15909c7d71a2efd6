//! The vocabulary every nibble crate shares: one error type whose messages name the file, tensor
//! or limit at fault, so a user can act on them without reading source.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A model file whose bytes do not follow its format (truncated, bad magic, offsets out of range).
    #[error("{path}: corrupt or truncated file: {reason}")]
    CorruptFile { path: PathBuf, reason: String },
    /// A well-formed file describing something nibble does not implement.
    #[error("{what} is not supported: {detail}")]
    Unsupported { what: String, detail: String },
    #[error("tensor '{name}': expected shape {expected:?}, found {found:?}")]
    ShapeMismatch {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor '{name}' is missing from {source_name}")]
    MissingTensor { name: String, source_name: String },
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("{what} is {value}, over the limit of {limit}")]
    LimitExceeded {
        what: String,
        value: usize,
        limit: usize,
    },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    pub fn corrupt(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Error::CorruptFile {
            path: path.into(),
            reason: reason.into(),
        }
    }

    pub fn unsupported(what: impl Into<String>, detail: impl Into<String>) -> Self {
        Error::Unsupported {
            what: what.into(),
            detail: detail.into(),
        }
    }
}
