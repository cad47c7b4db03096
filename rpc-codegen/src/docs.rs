//! `.proto` comments to rustdoc lines.

/// Turns the leading and trailing comments of a `.proto` item into doc lines: a space after
/// `///`, bare URLs in `<..>`, `[..]` that are not links escaped (rustdoc would take them for
/// intra-doc links), and code blocks marked `text` so that rustdoc does not compile them as
/// doctests.
pub(crate) fn doc_lines(leading: &[String], trailing: &[String]) -> Vec<String> {
    let mut raw: Vec<&str> = leading.iter().map(String::as_str).collect();
    if !leading.is_empty() && !trailing.is_empty() {
        raw.push("");
    }
    raw.extend(trailing.iter().map(String::as_str));
    // One blank line at most between paragraphs, none at both ends.
    raw.dedup_by(|b, a| a.trim().is_empty() && b.trim().is_empty());
    while raw.first().is_some_and(|l| l.trim().is_empty()) {
        raw.remove(0);
    }
    while raw.last().is_some_and(|l| l.trim().is_empty()) {
        raw.pop();
    }

    let mut out = Vec::with_capacity(raw.len());
    let mut in_fence = false;
    let mut in_indented = false;
    let mut prev_blank = true;
    for line in raw {
        // Comments usually start with one space (`// text`); count indentation beyond it.
        let body = line.strip_prefix(' ').unwrap_or(line);
        let trimmed = body.trim_start();
        if trimmed.starts_with("```") {
            if in_fence {
                in_fence = false;
                out.push(format!(" {body}"));
            } else {
                in_fence = true;
                let lang = trimmed.trim_start_matches('`').trim();
                let indent = &body[..body.len() - trimmed.len()];
                if lang.is_empty() || lang == "rust" {
                    out.push(format!(" {indent}```text"));
                } else {
                    out.push(format!(" {body}"));
                }
            }
            prev_blank = false;
            continue;
        }
        if in_fence {
            out.push(format!(" {body}"));
            continue;
        }
        let indented = body.starts_with("    ") && !trimmed.is_empty();
        if indented && (prev_blank || in_indented) {
            if !in_indented {
                out.push(" ```text".to_owned());
                in_indented = true;
            }
            out.push(format!(" {}", &body[4..]));
            continue;
        }
        if in_indented {
            out.push(" ```".to_owned());
            in_indented = false;
        }
        prev_blank = trimmed.is_empty();
        if trimmed.is_empty() {
            out.push(String::new());
        } else {
            out.push(format!(" {}", sanitize(body)));
        }
    }
    if in_indented || in_fence {
        out.push(" ```".to_owned());
    }
    out
}

/// Escapes `[x]` that is not followed by `(` or `[` (not a markdown link), and wraps bare URLs
/// in `<>`.
fn sanitize(line: &str) -> String {
    let chars: Vec<char> = line.chars().collect();
    let mut out = String::with_capacity(line.len() + 8);
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '\\' && i + 1 < chars.len() {
            out.push(c);
            out.push(chars[i + 1]);
            i += 2;
            continue;
        }
        if c == '['
            && let Some(close) = chars[i + 1..].iter().position(|&c| c == ']')
            && !matches!(chars.get(i + 1 + close + 1), Some('(') | Some('['))
        {
            let close = i + 1 + close;
            out.push_str("\\[");
            out.extend(&chars[i + 1..close]);
            out.push_str("\\]");
            i = close + 1;
            continue;
        }
        let rest: String = chars[i..].iter().take(8).collect();
        let prev = if i == 0 { None } else { Some(chars[i - 1]) };
        if (rest.starts_with("http://") || rest.starts_with("https://"))
            && !matches!(prev, Some('<') | Some('('))
        {
            let end = chars[i..]
                .iter()
                .position(|c| c.is_whitespace() || *c == ')' || *c == '>')
                .map_or(chars.len(), |p| i + p);
            out.push('<');
            out.extend(&chars[i..end]);
            out.push('>');
            i = end;
            continue;
        }
        out.push(c);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn leading_and_trailing_comments_are_joined() {
        let d = doc_lines(&lines(&[" Sends a greeting", ""]), &lines(&[" trailing"]));
        assert_eq!(d, lines(&[" Sends a greeting", "", " trailing"]));
    }

    #[test]
    fn brackets_and_urls_are_made_safe_for_rustdoc() {
        let d = doc_lines(
            &lines(&[
                " see [RFC 1] and [docs](https://x.y/z), or https://a.b/c.",
                "no space",
            ]),
            &[],
        );
        assert_eq!(
            d,
            lines(&[
                " see \\[RFC 1\\] and [docs](https://x.y/z), or <https://a.b/c.>",
                " no space"
            ])
        );
    }

    #[test]
    fn code_blocks_do_not_become_doctests() {
        let d = doc_lines(
            &lines(&[
                " Example:",
                "",
                "     let x = 1;",
                "     f(x);",
                "",
                " ```",
                " a b",
                " ```",
            ]),
            &[],
        );
        assert_eq!(
            d,
            lines(&[
                " Example:",
                "",
                " ```text",
                " let x = 1;",
                " f(x);",
                " ```",
                "",
                " ```text",
                " a b",
                " ```"
            ])
        );
    }
}
