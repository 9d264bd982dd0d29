//! Parameter paths, built on the stack and rendered only when an error needs one.

use std::fmt;

/// A location in the request body: `messages[2].content[0].image_url.url`.
#[derive(Clone, Copy)]
pub enum Path<'a> {
    /// The body itself.
    Root,
    /// A field of an object.
    Key(&'a Path<'a>, &'a str),
    /// An element of an array.
    Index(&'a Path<'a>, usize),
}

impl<'a> Path<'a> {
    /// The path of a field below this one.
    pub fn key(&'a self, key: &'a str) -> Path<'a> {
        Path::Key(self, key)
    }

    /// The path of an array element below this one.
    pub fn index(&'a self, index: usize) -> Path<'a> {
        Path::Index(self, index)
    }

    /// The rendered path (`""` for the root).
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(48);
        self.write_into(&mut out);
        out
    }

    fn write_into(&self, out: &mut String) {
        match self {
            Path::Root => {}
            Path::Key(parent, key) => {
                parent.write_into(out);
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key);
            }
            Path::Index(parent, index) => {
                parent.write_into(out);
                out.push('[');
                push_decimal(out, *index as u64);
                out.push(']');
            }
        }
    }
}

/// Appends `n` in decimal, as `write!("{n}")` would, without the formatting machinery
/// (paths are rendered on the success path too, for every media item, and so are the
/// integers of canonical JSON).
pub(crate) fn push_decimal(out: &mut String, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    for &d in &digits[i..] {
        out.push(char::from(d));
    }
}

impl fmt::Display for Path<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.render())
    }
}

impl fmt::Debug for Path<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Path({})", self.render())
    }
}

/// The body itself, as a `'static` path to build others on.
pub const ROOT: Path<'static> = Path::Root;

#[cfg(test)]
mod tests {
    use super::ROOT;

    #[test]
    fn renders_keys_and_indices() {
        let messages = ROOT.key("messages");
        let cases: [(usize, &str); 4] = [
            (0, "messages[0].content"),
            (9, "messages[9].content"),
            (10, "messages[10].content"),
            (1_234_567, "messages[1234567].content"),
        ];
        for (index, want) in cases {
            let m = messages.index(index);
            assert_eq!(m.key("content").render(), want);
        }
        assert_eq!(ROOT.render(), "");
        let nested = ROOT.index(3);
        assert_eq!(nested.index(42).render(), "[3][42]");
    }
}
