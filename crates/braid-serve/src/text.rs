//! Tokens to text as they come ([`TextStream`]): the text of every token
//! so far, of which only what is final goes out — not an unfinished UTF-8
//! character (decoded as U+FFFD until its last byte comes), not the start
//! of what may become a stop string. A stop string found ends the text
//! before it.

use braid_data::tokens::Tokenizer;

/// A completion's text, given out as it becomes final.
pub struct TextStream {
    tokenizer: Tokenizer,
    tokens: Vec<u32>,
    stop: Vec<String>,
    /// Bytes of the text given out so far.
    sent: usize,
}

impl TextStream {
    pub fn new(tokenizer: Tokenizer, stop: Vec<String>) -> TextStream {
        TextStream {
            tokenizer,
            tokens: Vec::new(),
            stop: stop.into_iter().filter(|s| !s.is_empty()).collect(),
            sent: 0,
        }
    }

    /// Adds a token: the text now final, and whether a stop string ended
    /// the completion (the text then stops before it).
    pub fn push(&mut self, token: u32) -> (String, bool) {
        self.tokens.push(token);
        let text = self.tokenizer.decode(&self.tokens);
        if let Some(at) = self.stop.iter().filter_map(|s| text.find(s.as_str())).min() {
            let out = text.get(self.sent..at).unwrap_or("").to_string();
            self.sent = at.max(self.sent);
            return (out, true);
        }
        let mut end = text.len();
        // An unfinished character decodes as U+FFFD at the end.
        while text[..end].ends_with('\u{FFFD}') {
            end -= '\u{FFFD}'.len_utf8();
        }
        // The longest end that begins some stop string waits.
        let hold = self
            .stop
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .rev()
                    .filter(|&k| s.is_char_boundary(k))
                    .find(|&k| text[..end].ends_with(&s[..k]))
            })
            .max()
            .unwrap_or(0);
        end -= hold;
        if end <= self.sent {
            return (String::new(), false);
        }
        let out = text[self.sent..end].to_string();
        self.sent = end;
        (out, false)
    }

    /// The text held back, at the end of a completion not ended by a stop
    /// string.
    pub fn rest(&mut self) -> String {
        let text = self.tokenizer.decode(&self.tokens);
        let out = text.get(self.sent..).unwrap_or("").to_string();
        self.sent = text.len();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(s: &str) -> Vec<u32> {
        s.bytes().map(u32::from).collect()
    }

    #[test]
    fn an_unfinished_character_waits_for_its_last_byte() {
        let mut t = TextStream::new(Tokenizer::Bytes, vec![]);
        let mut out = String::new();
        for b in bytes("aé€b") {
            out += &t.push(b).0;
        }
        out += &t.rest();
        assert_eq!(out, "aé€b");
        let mut t = TextStream::new(Tokenizer::Bytes, vec![]);
        let e = bytes("é");
        assert_eq!(t.push(e[0]).0, "");
        assert_eq!(t.push(e[1]).0, "é");
    }

    #[test]
    fn a_stop_string_ends_the_text_before_it_and_its_start_waits() {
        let mut t = TextStream::new(Tokenizer::Bytes, vec!["\n\n".into(), "END".into()]);
        let mut out = String::new();
        let mut stopped = false;
        for b in bytes("one\ntwo EN") {
            let (s, stop) = t.push(b);
            assert!(!stop);
            out += &s;
        }
        // "\n" waited until "t" showed it was no stop; "EN" waits still.
        assert_eq!(out, "one\ntwo ");
        for b in bytes("D more") {
            let (s, stop) = t.push(b);
            out += &s;
            if stop {
                stopped = true;
                break;
            }
        }
        assert!(stopped);
        assert_eq!(out, "one\ntwo ");
    }
}
