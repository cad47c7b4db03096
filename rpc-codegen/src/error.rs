//! [`Error`]: what [`Builder::compile`](crate::Builder::compile) reports, in protox's words and
//! with protox's locations, readable from `fn main() -> Result<(), Box<dyn Error>>`.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// Why [`Builder::compile`](crate::Builder::compile) failed: every problem found, each with the
/// place it points at when it has one. `Display` and `Debug` print the same report, one block
/// per problem, in the shape protox and rustc use:
///
/// ```text
/// error: name 'p.M' is defined twice
///  --> s.proto:4:9
///   |
/// 4 | message M {}
///   |         ^ defined again here
/// ```
///
/// so a build script's `fn main() -> Result<(), Box<dyn std::error::Error>>` shows it as is.
/// It converts into an `io::Error` for build scripts that return `io::Result`.
pub struct Error {
    problems: Vec<Problem>,
    source: Option<io::Error>,
}

/// One problem of an [`Error`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    message: String,
    at: Option<Location>,
    notes: Vec<Location>,
}

/// A place in a `.proto` file: 1-based line and column, the line's text when the file could be
/// read, the width to underline, and what the place is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    file: String,
    line: usize,
    column: usize,
    text: Option<String>,
    width: usize,
    label: String,
}

impl Error {
    /// An error made of `problems`.
    pub(crate) fn new(problems: Vec<Problem>) -> Self {
        Error {
            problems,
            source: None,
        }
    }

    /// An error reading or writing files: `what` failed because of `source`.
    pub(crate) fn io(what: impl fmt::Display, source: io::Error) -> Self {
        Error {
            problems: vec![Problem::new(format!("{what}: {source}"))],
            source: Some(source),
        }
    }

    /// Every problem found, in the order found.
    pub fn problems(&self) -> &[Problem] {
        &self.problems
    }
}

impl Problem {
    /// A problem without a location.
    pub(crate) fn new(message: impl Into<String>) -> Self {
        Problem {
            message: message.into(),
            at: None,
            notes: Vec::new(),
        }
    }

    /// The problem, placed at `at`.
    pub(crate) fn at(mut self, at: Option<Location>) -> Self {
        self.at = at;
        self
    }

    /// Adds a secondary place (the first definition of a duplicate, say).
    pub(crate) fn note(mut self, note: Location) -> Self {
        self.notes.push(note);
        self
    }

    /// What is wrong.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Where, when known: the offending definition, not an earlier valid one.
    pub fn location(&self) -> Option<&Location> {
        self.at.as_ref()
    }
}

impl Location {
    /// A place at 1-based `line` and `column` of `file`, `width` characters wide; the line's
    /// text is read from `file` under one of `includes` (or as a path) when it exists.
    pub(crate) fn new(
        file: &str,
        line: usize,
        column: usize,
        width: usize,
        label: impl Into<String>,
        includes: &[PathBuf],
    ) -> Self {
        Location {
            file: file.to_owned(),
            line,
            column,
            text: source_line(file, line, includes),
            width: width.max(1),
            label: label.into(),
        }
    }

    /// The file, as protox names it (relative to its include directory).
    pub fn file(&self) -> &str {
        &self.file
    }

    /// The 1-based line.
    pub fn line(&self) -> usize {
        self.line
    }

    /// The 1-based column, in characters.
    pub fn column(&self) -> usize {
        self.column
    }
}

/// Line `line` (1-based) of `file`, found under one of `includes` or as a path.
fn source_line(file: &str, line: usize, includes: &[PathBuf]) -> Option<String> {
    let candidates = includes
        .iter()
        .map(|dir| dir.join(file))
        .chain([Path::new(file).to_owned()]);
    for path in candidates {
        if let Ok(text) = std::fs::read_to_string(&path) {
            return text
                .lines()
                .nth(line.checked_sub(1)?)
                .map(|l| l.trim_end().to_owned());
        }
    }
    None
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "error: {}", self.message)?;
        let Some(at) = &self.at else {
            return Ok(());
        };
        let gutter = std::iter::once(at)
            .chain(&self.notes)
            .map(|l| l.line.to_string().len())
            .max()
            .unwrap_or(1);
        write!(
            f,
            "\n{:gutter$}--> {}:{}:{}",
            "", at.file, at.line, at.column
        )?;
        snippet(f, at, gutter)?;
        for note in &self.notes {
            if note.file != at.file {
                write!(
                    f,
                    "\n{:gutter$}::: {}:{}:{}",
                    "", note.file, note.line, note.column
                )?;
            }
            snippet(f, note, gutter)?;
        }
        Ok(())
    }
}

/// ` | <the line>` and ` | ^^^ label` under it (just the label when the line is unknown).
fn snippet(f: &mut fmt::Formatter<'_>, at: &Location, gutter: usize) -> fmt::Result {
    write!(f, "\n{:gutter$} |", "")?;
    match &at.text {
        Some(text) => {
            let indent: String = text
                .chars()
                .take(at.column.saturating_sub(1))
                .map(|c| if c == '\t' { '\t' } else { ' ' })
                .collect();
            write!(f, "\n{:>gutter$} | {text}", at.line)?;
            write!(
                f,
                "\n{:gutter$} | {indent}{} {}",
                "",
                "^".repeat(at.width),
                at.label
            )?;
        }
        None => write!(f, "\n{:gutter$} = {}", "", at.label)?,
    }
    Ok(())
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.problems.iter().enumerate() {
            if i > 0 {
                f.write_str("\n\n")?;
            }
            write!(f, "{p}")?;
        }
        if self.problems.len() > 1 {
            write!(
                f,
                "\n\nrpc-codegen: {} errors in the .proto files",
                self.problems.len()
            )?;
        }
        Ok(())
    }
}

/// The same report as `Display`: `fn main() -> Result<(), Box<dyn Error>>` prints `Debug`.
impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_ref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

impl From<Error> for io::Error {
    fn from(e: Error) -> Self {
        let kind = e
            .source
            .as_ref()
            .map_or(io::ErrorKind::Other, io::Error::kind);
        io::Error::new(kind, e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_problem_reads_like_rustc_with_a_caret_under_the_place() {
        let mut at = Location::new("a.proto", 4, 9, 1, "defined again here", &[]);
        at.text = Some("message M {}".into());
        let mut first = Location::new("a.proto", 3, 9, 1, "first defined here", &[]);
        first.text = Some("message M {}".into());
        let e = Error::new(vec![
            Problem::new("name 'p.M' is defined twice")
                .at(Some(at))
                .note(first),
        ]);
        let expected = "error: name 'p.M' is defined twice\n \
                        --> a.proto:4:9\n  |\n\
                        4 | message M {}\n  |         ^ defined again here\n  |\n\
                        3 | message M {}\n  |         ^ first defined here";
        assert_eq!(e.to_string(), expected);
        assert_eq!(format!("{e:?}"), expected);
    }

    #[test]
    fn io_errors_keep_their_kind_and_source() {
        let e = Error::io(
            "writing out/p.rs",
            io::Error::new(io::ErrorKind::PermissionDenied, "denied"),
        );
        assert_eq!(e.to_string(), "error: writing out/p.rs: denied");
        assert!(std::error::Error::source(&e).is_some());
        assert_eq!(io::Error::from(e).kind(), io::ErrorKind::PermissionDenied);
    }
}
