//! The ggml tensor element types as GGUF files number them, with their block geometry.

/// A ggml tensor element type, numbered as in GGUF files.
///
/// Every type stores its elements in blocks of [`GgmlType::block_size`] elements taking
/// [`GgmlType::type_size`] bytes. Ids that ggml has retired are not representable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
#[allow(non_camel_case_types, missing_docs)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    IQ2_XXS = 16,
    IQ2_XS = 17,
    IQ3_XXS = 18,
    IQ1_S = 19,
    IQ4_NL = 20,
    IQ3_S = 21,
    IQ2_S = 22,
    IQ4_XS = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    IQ1_M = 29,
    BF16 = 30,
    TQ1_0 = 34,
    TQ2_0 = 35,
    MXFP4 = 39,
}

/// Elements per block of the k-quant formats.
pub const QK_K: usize = 256;

impl GgmlType {
    /// Every type, in id order.
    pub const ALL: [GgmlType; 32] = [
        Self::F32,
        Self::F16,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q8_1,
        Self::Q2_K,
        Self::Q3_K,
        Self::Q4_K,
        Self::Q5_K,
        Self::Q6_K,
        Self::Q8_K,
        Self::IQ2_XXS,
        Self::IQ2_XS,
        Self::IQ3_XXS,
        Self::IQ1_S,
        Self::IQ4_NL,
        Self::IQ3_S,
        Self::IQ2_S,
        Self::IQ4_XS,
        Self::I8,
        Self::I16,
        Self::I32,
        Self::I64,
        Self::F64,
        Self::IQ1_M,
        Self::BF16,
        Self::TQ1_0,
        Self::TQ2_0,
        Self::MXFP4,
    ];

    /// The type with GGUF id `id`, if ggml defines it.
    pub fn from_id(id: u32) -> Option<Self> {
        Self::ALL.iter().copied().find(|t| *t as u32 == id)
    }

    /// The GGUF id of this type.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 | I8 | I16 | I32 | I64 | F64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | IQ4_NL | MXFP4 => 32,
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q8_K | IQ2_XXS | IQ2_XS | IQ3_XXS | IQ1_S
            | IQ3_S | IQ2_S | IQ4_XS | IQ1_M | TQ1_0 | TQ2_0 => QK_K,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | I32 => 4,
            F16 | BF16 | I16 => 2,
            I8 => 1,
            I64 | F64 => 8,
            Q4_0 => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q8_0 => 34,
            Q8_1 => 36,
            Q2_K => 84,
            Q3_K => 110,
            Q4_K => 144,
            Q5_K => 176,
            Q6_K => 210,
            Q8_K => 292,
            IQ2_XXS => 66,
            IQ2_XS => 74,
            IQ3_XXS => 98,
            IQ1_S => 50,
            IQ4_NL => 18,
            IQ3_S => 110,
            IQ2_S => 82,
            IQ4_XS => 136,
            IQ1_M => 56,
            TQ1_0 => 54,
            TQ2_0 => 66,
            MXFP4 => 17,
        }
    }

    /// Bytes taken by a row of `n` elements, or `None` when `n` is not a whole number of
    /// blocks or the size overflows.
    pub fn row_size(self, n: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        if !n.is_multiple_of(bs) {
            return None;
        }
        (n / bs).checked_mul(self.type_size() as u64)
    }

    /// The name ggml gives this type (`"q4_1"`, `"f16"`, ...).
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "f32",
            F16 => "f16",
            Q4_0 => "q4_0",
            Q4_1 => "q4_1",
            Q5_0 => "q5_0",
            Q5_1 => "q5_1",
            Q8_0 => "q8_0",
            Q8_1 => "q8_1",
            Q2_K => "q2_K",
            Q3_K => "q3_K",
            Q4_K => "q4_K",
            Q5_K => "q5_K",
            Q6_K => "q6_K",
            Q8_K => "q8_K",
            IQ2_XXS => "iq2_xxs",
            IQ2_XS => "iq2_xs",
            IQ3_XXS => "iq3_xxs",
            IQ1_S => "iq1_s",
            IQ4_NL => "iq4_nl",
            IQ3_S => "iq3_s",
            IQ2_S => "iq2_s",
            IQ4_XS => "iq4_xs",
            I8 => "i8",
            I16 => "i16",
            I32 => "i32",
            I64 => "i64",
            F64 => "f64",
            IQ1_M => "iq1_m",
            BF16 => "bf16",
            TQ1_0 => "tq1_0",
            TQ2_0 => "tq2_0",
            MXFP4 => "mxfp4",
        }
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_retired_ids_are_rejected() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
        }
        for retired in [4, 5, 31, 32, 33, 36, 37, 38, 40, u32::MAX] {
            assert_eq!(GgmlType::from_id(retired), None, "id {retired}");
        }
    }

    #[test]
    fn row_sizes() {
        assert_eq!(GgmlType::Q4_1.row_size(576), Some(18 * 20));
        assert_eq!(GgmlType::Q8_0.row_size(576), Some(18 * 34));
        assert_eq!(GgmlType::Q6_K.row_size(512), Some(2 * 210));
        assert_eq!(GgmlType::Q4_K.row_size(100), None);
        assert_eq!(GgmlType::F32.row_size(3), Some(12));
        assert_eq!(GgmlType::Q8_0.row_size(u64::MAX - 31), None);
    }
}
