//! The `Idempotency-Key` header, as the IETF httpapi draft defines it, for
//! both edges that read one: the HTTP/JSON edge and the Envoy doors. No
//! transport here: a header's bytes in, the key (or why not) out; the Gate
//! then validates the key as any other.

/// The key of an `Idempotency-Key` value: a structured-field string (RFC
/// 8941: `"abc"`, with `\"` and `\\` escapes, printable ASCII); a bare
/// value, as many clients send one, is taken as it is, trimmed. A value
/// that opens a string must be one whole string: `"a", "b"` is two keys a
/// proxy joined (repeated headers are joined with commas), never the key
/// `a", "b`; parameters (`"a";x=1`) are not taken.
pub fn header_key(value: &[u8]) -> Result<String, &'static str> {
    let value = String::from_utf8_lossy(value);
    let trimmed = value.trim();
    let Some(rest) = trimmed.strip_prefix('"') else {
        return Ok(trimmed.to_owned());
    };
    let mut out = String::with_capacity(rest.len());
    let mut chars = rest.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(escaped @ ('"' | '\\')) => out.push(escaped),
                _ => return Err("a structured-field string may escape only \" and \\"),
            },
            '"' if chars.as_str().is_empty() => return Ok(out),
            '"' => {
                return Err(
                    "more after the structured-field string's closing quote (parameters, or two idempotency keys joined into one header): one string only",
                );
            }
            ' '..='~' => out.push(c),
            _ => return Err("a structured-field string holds printable ASCII only"),
        }
    }
    Err("a structured-field string without its closing quote")
}

#[cfg(test)]
mod tests {
    use super::header_key;

    #[test]
    fn a_structured_field_string_is_unescaped() {
        assert_eq!(header_key(br#""k-1""#).unwrap(), "k-1");
        assert_eq!(header_key(br#" "a \"b\" \\c" "#).unwrap(), r#"a "b" \c"#);
        assert_eq!(
            header_key(br#"" x ""#).unwrap(),
            " x ",
            "inside the quotes, kept"
        );
        assert_eq!(header_key(br#""""#).unwrap(), "", "the Gate refuses it");
    }

    /// Bare, the value is the key: the Gate judges it as any key (it
    /// refuses the empty one and what is not printable ASCII).
    #[test]
    fn a_bare_value_is_the_key_trimmed() {
        assert_eq!(header_key(b"8e03978e-40d5").unwrap(), "8e03978e-40d5");
        assert_eq!(header_key(b" k-1 ").unwrap(), "k-1");
        assert_eq!(header_key(b"a,b").unwrap(), "a,b");
        assert_eq!(header_key(b"").unwrap(), "");
    }

    #[test]
    fn a_value_that_opens_a_string_must_be_one_whole_string() {
        for (bad, says) in [
            (&br#""k"#[..], "closing quote"),
            (br#""k";a=1"#, "parameters"),
            (br#""a", "b""#, "two idempotency keys joined"),
            (br#""k\n""#, "escape only"),
            (b"\"k\xc3\xa9\"", "printable ASCII"),
            (b"\"k\x7f\"", "printable ASCII"),
        ] {
            let why = header_key(bad).expect_err(&String::from_utf8_lossy(bad));
            assert!(
                why.contains(says),
                "{:?}: {why}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
