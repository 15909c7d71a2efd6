//! Streaming stop-string detection. Text arrives a token at a time, and a stop string can span
//! several tokens, so anything that might be the start of a stop string is held back until the
//! following text proves it is not: a client must never see part of a stop string.

/// Incremental matcher over decoded text.
///
/// The result is independent of how the text is chunked: when several stop strings complete in
/// one push, the one that ends first wins (as it would had the text arrived a character at a
/// time), and among those ending at the same place the longest.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Tail of the text that is a proper prefix of some stop string; always starts on a char
    /// boundary because it is sliced at one.
    held: String,
    stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        // An empty stop string would match before the first character and end every generation
        // at once; treat it as a client mistake rather than a request for empty output.
        let stops = stops.into_iter().filter(|s| !s.is_empty()).collect();
        Self {
            stops,
            held: String::new(),
            stopped: false,
        }
    }

    /// Feed newly decoded text; returns (text safe to emit now, whether a stop string was hit).
    /// Text that could be the beginning of a stop string is held back until disambiguated; on a
    /// hit, emitted text ends right before the stop string. After a hit, further input is
    /// discarded and every call reports the hit again.
    pub fn push(&mut self, text: &str) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        if self.stops.is_empty() {
            return (text.to_owned(), false);
        }
        let mut buf = std::mem::take(&mut self.held);
        buf.push_str(text);

        // (end, start) of the earliest-ending, then longest, complete match.
        let hit = self
            .stops
            .iter()
            .filter_map(|s| buf.find(s.as_str()).map(|start| (start + s.len(), start)))
            .min_by_key(|&(end, start)| (end, std::cmp::Reverse(end - start)));
        if let Some((_, start)) = hit {
            self.stopped = true;
            buf.truncate(start);
            return (buf, true);
        }

        let keep_from = self.held_back_start(&buf);
        self.held = buf.split_off(keep_from);
        (buf, false)
    }

    /// End of generation: returns held-back text, which can no longer become a stop string.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Whether a stop string has been seen.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Byte offset of the earliest suffix of `buf` that is a prefix of some stop string, or
    /// `buf.len()` if none is. Earliest, not longest-matching, because every such suffix is a
    /// live candidate and emitting any of it could leak part of a stop string.
    fn held_back_start(&self, buf: &str) -> usize {
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        // A suffix at least as long as every stop string cannot be a *proper* prefix of one (a
        // complete match was ruled out above), so only the last `longest - 1` bytes matter.
        let window = buf.len().saturating_sub(longest - 1);
        buf.char_indices()
            .map(|(i, _)| i)
            .skip_while(|&i| i < window)
            .find(|&i| {
                let tail = &buf.as_bytes()[i..];
                self.stops.iter().any(|s| s.as_bytes().starts_with(tail))
            })
            .unwrap_or(buf.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(stops: &[&str]) -> StopMatcher {
        StopMatcher::new(stops.iter().map(|s| s.to_string()).collect())
    }

    /// Feeds `chunks` and returns everything emitted (including `finish`) and whether it stopped.
    fn run(stops: &[&str], chunks: &[&str]) -> (String, bool) {
        let mut m = matcher(stops);
        let mut out = String::new();
        let mut hit = false;
        for c in chunks {
            let (text, h) = m.push(c);
            out.push_str(&text);
            if h {
                hit = true;
                break;
            }
        }
        out.push_str(&m.finish());
        (out, hit)
    }

    #[test]
    fn no_stops_passes_through() {
        let mut m = matcher(&[]);
        assert_eq!(m.push("hello"), ("hello".into(), false));
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn hit_within_one_push() {
        let mut m = matcher(&["world"]);
        assert_eq!(m.push("Hello world, bye"), ("Hello ".into(), true));
        assert!(m.stopped());
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn hit_split_across_pushes() {
        let mut m = matcher(&["world"]);
        assert_eq!(m.push("Hel"), ("Hel".into(), false));
        assert_eq!(m.push("lo wo"), ("lo ".into(), false));
        assert_eq!(m.push("r"), ("".into(), false));
        assert_eq!(m.push("ld!"), ("".into(), true));
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn false_alarm_releases_held_text() {
        let mut m = matcher(&["world"]);
        assert_eq!(m.push("a wor"), ("a ".into(), false));
        assert_eq!(m.push("m"), ("worm".into(), false));
        assert!(!m.stopped());
    }

    #[test]
    fn finish_flushes_held_text() {
        let mut m = matcher(&["</s>"]);
        assert_eq!(m.push("end </"), ("end ".into(), false));
        assert_eq!(m.finish(), "</");
        // Nothing held after flushing.
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn pushes_after_hit_are_discarded() {
        let mut m = matcher(&["STOP"]);
        assert_eq!(m.push("aSTOPb"), ("a".into(), true));
        assert_eq!(m.push("more"), ("".into(), true));
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn overlapping_self_prefix() {
        // After "aaa" only the last two a's can start "aab"; the first must be released.
        let mut m = matcher(&["aab"]);
        assert_eq!(m.push("a"), ("".into(), false));
        assert_eq!(m.push("a"), ("".into(), false));
        assert_eq!(m.push("a"), ("a".into(), false));
        assert_eq!(m.push("b"), ("".into(), true));
    }

    #[test]
    fn multiple_stops_earliest_end_wins() {
        // "cd" completes before "abcdef" does, so a char-by-char stream would stop there.
        assert_eq!(run(&["abcdef", "cd"], &["xabcdef"]), ("xab".into(), true));
        assert_eq!(
            run(&["abcdef", "cd"], &["xab", "c", "def"]),
            ("xab".into(), true)
        );
        // Same end: the longer stop string is cut entirely.
        assert_eq!(run(&["d", "bcd"], &["abcde"]), ("a".into(), true));
        // Different stops each held back as a possible prefix.
        let mut m = matcher(&["<|end|>", "\n\nUser:"]);
        assert_eq!(m.push("Hi\n"), ("Hi".into(), false));
        assert_eq!(m.push("\nUs"), ("".into(), false));
        assert_eq!(m.push("e"), ("".into(), false));
        assert_eq!(m.push("d"), ("\n\nUsed".into(), false));
        assert_eq!(m.push(" <|e"), (" ".into(), false));
        assert_eq!(m.push("nd|>tail"), ("".into(), true));
    }

    #[test]
    fn utf8_stop_split_across_pushes() {
        let mut m = matcher(&["日本"]);
        assert_eq!(m.push("こんにちは日"), ("こんにちは".into(), false));
        assert_eq!(m.push("本語"), ("".into(), true));
        let mut m = matcher(&["日本"]);
        assert_eq!(m.push("日"), ("".into(), false));
        assert_eq!(m.push("曜日"), ("日曜".into(), false));
        assert_eq!(m.finish(), "日");
    }

    #[test]
    fn utf8_shared_leading_bytes_do_not_split_chars() {
        // '₂' (E2 82 82) and '€' (E2 82 AC) share two leading bytes; a byte-wise scan would try
        // to hold back half of '₂'.
        let mut m = matcher(&["€"]);
        assert_eq!(m.push("a₂"), ("a₂".into(), false));
        assert_eq!(m.push("x€y"), ("x".into(), true));
        let mut m = matcher(&["é!"]);
        assert_eq!(m.push("ê"), ("ê".into(), false));
        assert_eq!(m.push("é"), ("".into(), false));
        assert_eq!(m.finish(), "é");
    }

    #[test]
    fn empty_stop_strings_are_ignored() {
        assert_eq!(run(&[""], &["abc"]), ("abc".into(), false));
        assert_eq!(run(&["", "c"], &["abc"]), ("ab".into(), true));
    }

    #[test]
    fn result_is_independent_of_chunking() {
        let cases: &[(&str, &[&str])] = &[
            ("The answer is 42.</s>ignored", &["</s>"]),
            ("aaaab aab", &["aab"]),
            ("xxabcdefyy", &["abcdef", "cd", "bcx"]),
            ("Ünïcödé 日本語 text ₂€ end", &["語 t", "€ e", "日本人"]),
            ("no stop here <", &["<stop>"]),
            ("User: hi\n\nUser: again", &["\n\nUser:", "\nUser"]),
            ("ababababac", &["ababac", "babad"]),
        ];
        for &(text, stops) in cases {
            let whole = run(stops, &[text]);
            let chars: Vec<String> = text.chars().map(String::from).collect();
            let chars: Vec<&str> = chars.iter().map(String::as_str).collect();
            assert_eq!(
                run(stops, &chars),
                whole,
                "char-by-char: {text:?} {stops:?}"
            );
            // Every two-way and a set of three-way splits at char boundaries.
            let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
            for &a in &bounds {
                let two = [&text[..a], &text[a..]];
                assert_eq!(run(stops, &two), whole, "split at {a}: {text:?} {stops:?}");
                for &b in bounds.iter().filter(|&&b| b > a).step_by(3) {
                    let three = [&text[..a], &text[a..b], &text[b..]];
                    assert_eq!(run(stops, &three), whole, "split {a},{b}: {text:?}");
                }
            }
        }
        // Spot-check the expected whole-text answers themselves.
        assert_eq!(
            run(&["</s>"], &["The answer is 42.</s>ignored"]),
            ("The answer is 42.".into(), true)
        );
        assert_eq!(
            run(&["<stop>"], &["no stop here <"]),
            ("no stop here <".into(), false)
        );
        assert_eq!(
            run(&["\n\nUser:", "\nUser"], &["User: hi\n\nUser: again"]),
            ("User: hi\n".into(), true)
        );
    }
}
