//! OCI content digests (`algorithm:hex`) for the two registered algorithms, sha256 and
//! sha512, and a streaming hasher for either.
//!
//! Invariant kept here: a `Digest` value is always well formed (known algorithm, lowercase
//! hex of the algorithm's length), so it is safe to turn into a storage key.

use std::fmt;
use std::str::FromStr;

use sha2::Digest as _;

/// A digest algorithm registered by the OCI image spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Algorithm {
    Sha256,
    Sha512,
}

impl Algorithm {
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Sha256 => "sha256",
            Algorithm::Sha512 => "sha512",
        }
    }

    fn hex_len(self) -> usize {
        match self {
            Algorithm::Sha256 => 64,
            Algorithm::Sha512 => 128,
        }
    }

    pub fn hasher(self) -> Hasher {
        match self {
            Algorithm::Sha256 => Hasher::Sha256(sha2::Sha256::new()),
            Algorithm::Sha512 => Hasher::Sha512(sha2::Sha512::new()),
        }
    }
}

/// Why a string is not a usable digest.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DigestError {
    #[error("digest {0:?} has no `algorithm:` prefix")]
    MissingAlgorithm(String),
    #[error("digest algorithm {0:?} is not supported (sha256 and sha512 are)")]
    UnsupportedAlgorithm(String),
    #[error("digest {0:?} must have {1} lowercase hex characters after the algorithm")]
    BadEncoding(String, usize),
}

/// A well-formed OCI digest.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest {
    algorithm: Algorithm,
    hex: String,
}

impl Digest {
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    pub fn hex(&self) -> &str {
        &self.hex
    }

    /// The digest of `data` with `algorithm`.
    pub fn of(algorithm: Algorithm, data: &[u8]) -> Digest {
        let mut h = algorithm.hasher();
        h.update(data);
        h.finish()
    }
}

impl FromStr for Digest {
    type Err = DigestError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (alg, hex) = s
            .split_once(':')
            .ok_or_else(|| DigestError::MissingAlgorithm(s.to_string()))?;
        let algorithm = match alg {
            "sha256" => Algorithm::Sha256,
            "sha512" => Algorithm::Sha512,
            other => return Err(DigestError::UnsupportedAlgorithm(other.to_string())),
        };
        let ok = hex.len() == algorithm.hex_len()
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if !ok {
            return Err(DigestError::BadEncoding(s.to_string(), algorithm.hex_len()));
        }
        Ok(Digest {
            algorithm,
            hex: hex.to_string(),
        })
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.algorithm.name(), self.hex)
    }
}

impl serde::Serialize for Digest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Digest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A streaming hasher for one algorithm.
#[derive(Clone)]
pub enum Hasher {
    Sha256(sha2::Sha256),
    Sha512(sha2::Sha512),
}

impl Hasher {
    pub fn update(&mut self, data: &[u8]) {
        match self {
            Hasher::Sha256(h) => h.update(data),
            Hasher::Sha512(h) => h.update(data),
        }
    }

    pub fn finish(self) -> Digest {
        let (algorithm, hex) = match self {
            Hasher::Sha256(h) => (Algorithm::Sha256, hex::encode(h.finalize())),
            Hasher::Sha512(h) => (Algorithm::Sha512, hex::encode(h.finalize())),
        };
        Digest { algorithm, hex }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_algorithms_and_round_trips() {
        let d = Digest::of(Algorithm::Sha256, b"hello");
        assert_eq!(
            d.to_string(),
            "sha256:2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
        );
        assert_eq!(d.to_string().parse::<Digest>().unwrap(), d);
        let d512 = Digest::of(Algorithm::Sha512, b"hello");
        assert_eq!(d512.hex().len(), 128);
        assert_eq!(d512.to_string().parse::<Digest>().unwrap(), d512);
    }

    #[test]
    fn rejects_bad_digests() {
        for bad in [
            "",
            "sha256",
            "md5:abcd",
            "sha256:XYZ",
            "sha256:ABCDEF0000000000000000000000000000000000000000000000000000000000",
            "sha256:abc",
            "sha256:../../../../etc/passwd",
            "sha512:2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824",
        ] {
            assert!(bad.parse::<Digest>().is_err(), "{bad:?} accepted");
        }
    }
}
