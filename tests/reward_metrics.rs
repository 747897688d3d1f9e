//! pass@k against an independent computation of 1 - C(n-c, k) / C(n, k) with exact binomials.

use grpo::reward::pass_at_k;
use num_bigint::BigUint;
use num_traits::{One, ToPrimitive, Zero};
use rand::{Rng, SeedableRng};

fn binom(n: usize, k: usize) -> BigUint {
    if k > n {
        return BigUint::zero();
    }
    let mut r = BigUint::one();
    for i in 0..k {
        r = r * BigUint::from(n - i) / BigUint::from(i + 1);
    }
    r
}

#[test]
fn pass_at_k_matches_exact_binomials() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    for _ in 0..2000 {
        let n = rng.gen_range(1..=200usize);
        let c = rng.gen_range(0..=n);
        let k = rng.gen_range(1..=n);
        let num = binom(n - c, k);
        let den = binom(n, k);
        // Exact ratio to f64: scale to keep 1e-15 precision.
        let scale = BigUint::from(10u64).pow(18);
        let ratio = (num * &scale / den).to_f64().unwrap() / 1e18;
        let expect = 1.0 - ratio;
        let got = pass_at_k(n, c, k);
        assert!((got - expect).abs() < 1e-9, "n={n} c={c} k={k}: {got} vs {expect}");
    }
}
