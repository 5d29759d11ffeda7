//! The fixed binary layout of a `.beton` file, as FFCV 1.0's
//! `ffcv/types.py` and `ffcv/writer.py` define it (numpy dtypes with
//! `align=True`, every integer little-endian):
//!
//! ```text
//! 0      header        24 bytes: version u16 (2), num_fields u16,
//!                      page_size u32, num_samples u64, alloc_table_ptr u64
//! 24     field table   num_fields × 1041 bytes: type_id u8, name [u8; 16]
//!                      (ASCII, NUL-padded), arguments [u8; 1024]
//! …      metadata      num_samples × one C struct of the fields' metadata
//!                      (each field aligned to its own alignment)
//! page   data region   pages of page_size bytes, starting at the first
//!                      page boundary after the metadata; a sample's
//!                      payloads never straddle two pages
//! ptr    alloc table   to the end of the file: (sample_id u64, ptr u64,
//!                      size u64) per payload
//! ```

/// The format version FFCV 1.0 writes and reads.
pub const VERSION: u16 = 2;
/// Bytes of the header.
pub const HEADER_SIZE: usize = 24;
/// Bytes of one field descriptor.
pub const FIELD_DESC_SIZE: usize = 1 + NAME_SIZE + ARGS_SIZE;
/// Bytes of a field's name in its descriptor.
pub const NAME_SIZE: usize = 16;
/// Bytes of a field's arguments in its descriptor.
pub const ARGS_SIZE: usize = 1024;
/// Bytes of one allocation-table entry.
pub const ALLOC_ENTRY_SIZE: usize = 24;
/// FFCV's smallest page (its writer refuses smaller ones: 2 MiB, the usual
/// huge page).
pub const FFCV_MIN_PAGE_SIZE: u64 = 1 << 21;
/// FFCV's default page size (`4 × 2 MiB`).
pub const DEFAULT_PAGE_SIZE: u64 = 4 * FFCV_MIN_PAGE_SIZE;
/// The smallest page braid writes or reads (a memory page). Files with
/// pages below FFCV's 2 MiB read in FFCV, but its writer cannot make them.
pub const MIN_PAGE_SIZE: u64 = 1 << 12;
/// Pages must stay below 4 GiB (the header holds them in a u32).
pub const MAX_PAGE_SIZE: u64 = 1 << 32;

/// The header at the start of every file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Format version ([`VERSION`]).
    pub version: u16,
    /// Fields per sample.
    pub num_fields: u16,
    /// Bytes per page of the data region.
    pub page_size: u32,
    /// Samples in the file.
    pub num_samples: u64,
    /// Where the allocation table starts.
    pub alloc_table_ptr: u64,
}

impl Header {
    /// The header's 24 bytes.
    pub fn encode(&self) -> [u8; HEADER_SIZE] {
        let mut b = [0u8; HEADER_SIZE];
        b[0..2].copy_from_slice(&self.version.to_le_bytes());
        b[2..4].copy_from_slice(&self.num_fields.to_le_bytes());
        b[4..8].copy_from_slice(&self.page_size.to_le_bytes());
        b[8..16].copy_from_slice(&self.num_samples.to_le_bytes());
        b[16..24].copy_from_slice(&self.alloc_table_ptr.to_le_bytes());
        b
    }

    /// Reads the header from the file's first 24 bytes.
    pub fn decode(b: &[u8; HEADER_SIZE]) -> Header {
        Header {
            version: u16_at(b, 0),
            num_fields: u16_at(b, 2),
            page_size: u32_at(b, 4),
            num_samples: u64_at(b, 8),
            alloc_table_ptr: u64_at(b, 16),
        }
    }
}

/// Where the metadata starts for `num_fields` fields.
pub fn metadata_start(num_fields: usize) -> u64 {
    (HEADER_SIZE + num_fields * FIELD_DESC_SIZE) as u64
}

/// `ptr` rounded up to a multiple of `page_size` (a power of two).
pub fn align_to_page(ptr: u64, page_size: u64) -> u64 {
    ptr.div_ceil(page_size) * page_size
}

/// One payload in the allocation table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    /// The sample that owns it.
    pub sample_id: u64,
    /// Where it starts in the file.
    pub ptr: u64,
    /// Its bytes.
    pub size: u64,
}

impl Allocation {
    /// The entry's 24 bytes.
    pub fn encode(&self) -> [u8; ALLOC_ENTRY_SIZE] {
        let mut b = [0u8; ALLOC_ENTRY_SIZE];
        b[0..8].copy_from_slice(&self.sample_id.to_le_bytes());
        b[8..16].copy_from_slice(&self.ptr.to_le_bytes());
        b[16..24].copy_from_slice(&self.size.to_le_bytes());
        b
    }

    /// The entry in `b` (24 bytes).
    pub fn decode(b: &[u8]) -> Allocation {
        Allocation {
            sample_id: u64_at(b, 0),
            ptr: u64_at(b, 8),
            size: u64_at(b, 16),
        }
    }
}

/// The little-endian u16 at `at` of `b` (in bounds by the caller).
pub fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// The little-endian u32 at `at` of `b`.
pub fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// The little-endian u64 at `at` of `b`.
pub fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_sizes_match_ffcv() {
        let h = Header {
            version: VERSION,
            num_fields: 3,
            page_size: 1 << 23,
            num_samples: 12345,
            alloc_table_ptr: 1 << 40,
        };
        assert_eq!(Header::decode(&h.encode()), h);
        assert_eq!(FIELD_DESC_SIZE, 1041);
        assert_eq!(metadata_start(2), 24 + 2082);
        assert_eq!(align_to_page(4097, 4096), 8192);
        assert_eq!(align_to_page(8192, 4096), 8192);
        let a = Allocation {
            sample_id: 7,
            ptr: 1 << 33,
            size: 99,
        };
        assert_eq!(Allocation::decode(&a.encode()), a);
    }
}
