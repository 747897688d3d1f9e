//! ZeRO-1: the optimiser state (f32 master weights and AdamW's moments) sharded over the ranks of a
//! data-parallel run.
//!
//! The trainable parameters, flattened in order and concatenated, form one flat vector of P values, cut into
//! N blocks of S = ceil(P / N); rank r owns block r (clipped to P) and keeps the state of its part of each
//! parameter it overlaps (on the model's device, or in host memory with `optim.offload`). A step
//! reduce-scatters the gradients (each rank receives the sum over the ranks of its block), takes the global
//! norm from the ranks' sums of squares (clipping on the global norm), updates its block, and all-gathers
//! the new weights into every rank's model. AdamW is element-wise, so the update is the one-process update.
//!
//! A checkpoint holds one `optimizer-RRRRR-of-NNNNN.safetensors` per rank (its block: `master`, `exp_avg`,
//! `exp_avg_sq` and `flat_range` = [start, end, P]), or `optimizer.safetensors` from one process (a tensor
//! per parameter); [`Saved`] reads either by flat ranges, so a run resumes at any world size.

use std::ops::Range;
use std::path::Path;
use std::rc::Rc;

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor, Var};

use crate::dist::World;
use crate::model::Grads;

/// The optimiser state of one process.
pub(super) const WHOLE_FILE: &str = "optimizer.safetensors";

/// The optimiser state of rank `rank` of `ranks`.
pub(super) fn shard_file(rank: usize, ranks: usize) -> String {
    format!("optimizer-{rank:05}-of-{ranks:05}.safetensors")
}

/// The world size of a shard file's name.
fn ranks_of(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("optimizer-")?.strip_suffix(".safetensors")?;
    let (rank, ranks) = rest.split_once("-of-")?;
    rank.parse::<usize>().ok()?;
    ranks.parse().ok()
}

/// The optimiser files checkpoint `ck` must hold: `optimizer.safetensors`, or every rank's shard; those
/// present and those missing.
pub(super) fn optimizer_files(ck: &Path) -> (Vec<String>, Vec<String>) {
    if ck.join(WHOLE_FILE).is_file() {
        return (vec![WHOLE_FILE.into()], Vec::new());
    }
    let ranks =
        std::fs::read_dir(ck).into_iter().flatten().flatten().find_map(|e| ranks_of(&e.file_name().to_string_lossy()));
    let Some(ranks) = ranks else { return (Vec::new(), vec![WHOLE_FILE.into()]) };
    (0..ranks).map(|r| shard_file(r, ranks)).partition(|f| ck.join(f).is_file())
}

/// The names of the three parts of the state.
pub(super) const MASTER: &str = "master";
pub(super) const EXP_AVG: &str = "exp_avg";
pub(super) const EXP_AVG_SQ: &str = "exp_avg_sq";
const RANGE: &str = "flat_range";

/// The flat order of the trainable parameters.
pub(super) struct Layout {
    names: Vec<String>,
    shapes: Vec<Vec<usize>>,
    /// Where each parameter starts in the flat vector.
    starts: Vec<usize>,
    total: usize,
}

/// A part of one parameter: `len` values from `offset` of the flattened parameter `param`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Piece {
    pub param: usize,
    pub offset: usize,
    pub len: usize,
}

impl Layout {
    pub fn new(names: &[String], shapes: Vec<Vec<usize>>) -> Self {
        let mut starts = Vec::with_capacity(shapes.len());
        let mut total = 0;
        for s in &shapes {
            starts.push(total);
            total += s.iter().product::<usize>();
        }
        Self { names: names.to_vec(), shapes, starts, total }
    }

    /// The number of flat values.
    pub fn total(&self) -> usize {
        self.total
    }

    fn numel(&self, param: usize) -> usize {
        self.shapes[param].iter().product()
    }

    pub fn shape(&self, param: usize) -> &[usize] {
        &self.shapes[param]
    }

    /// Where parameter `param` starts in the flat vector.
    pub fn start(&self, param: usize) -> usize {
        self.starts[param]
    }

    /// The length of each rank's block among `ranks`.
    fn block(&self, ranks: usize) -> usize {
        self.total.div_ceil(ranks)
    }

    /// The flat values rank `rank` of `ranks` owns.
    pub fn range(&self, rank: usize, ranks: usize) -> Range<usize> {
        let s = self.block(ranks);
        (rank * s).min(self.total)..((rank + 1) * s).min(self.total)
    }

    /// The parts of the parameters that the flat `range` covers, in order.
    pub fn pieces(&self, range: Range<usize>) -> Vec<Piece> {
        let mut out = Vec::new();
        for (param, &start) in self.starts.iter().enumerate() {
            let end = start + self.numel(param);
            let (a, b) = (range.start.max(start), range.end.min(end));
            if a < b {
                out.push(Piece { param, offset: a - start, len: b - a });
            }
        }
        out
    }

    /// The flat vector of the gradients (zeros for a parameter without one), padded with zeros to `len`.
    fn flatten(&self, grads: &Grads, len: usize) -> candle_core::Result<Vec<f32>> {
        let mut flat = Vec::with_capacity(len);
        for param in 0..self.shapes.len() {
            match grads.grads.get(param).and_then(|g| g.as_ref()) {
                Some(g) => flat.extend(g.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?),
                None => flat.resize(flat.len() + self.numel(param), 0.0),
            }
        }
        flat.resize(len, 0.0);
        Ok(flat)
    }
}

/// This rank's block of the state and the collectives that join it to the others'.
pub(super) struct Shard {
    world: Rc<World>,
    layout: Layout,
    vars: Vec<Var>,
}

impl Shard {
    pub fn new(world: Rc<World>, names: &[String], vars: &[Var]) -> Self {
        let layout = Layout::new(names, vars.iter().map(|v| v.dims().to_vec()).collect());
        Self { world, layout, vars: vars.to_vec() }
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The flat values this rank owns.
    pub fn range(&self) -> Range<usize> {
        self.layout.range(self.world.rank(), self.world.size())
    }

    /// The sum over the ranks of the gradients of this rank's block, and the global norm of the summed
    /// gradients (f64 sums of squares of the blocks, summed over the ranks).
    pub fn reduce(&self, grads: &Grads) -> candle_core::Result<(Vec<f32>, f64)> {
        let (n, s) = (self.world.size(), self.layout.block(self.world.size()));
        let flat = self.layout.flatten(grads, n * s)?;
        let mut mine = vec![0f32; s];
        self.world.reduce_scatter_sum_f32(&flat, &mut mine);
        mine.truncate(self.range().len());
        let mut sq = [mine.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>()];
        self.world.sum_f64(&mut sq);
        Ok((mine, sq[0].sqrt()))
    }

    /// Every rank's new f32 weights (`mine`: this rank's block) into every rank's model, in its dtype.
    pub fn gather(&self, mine: &[f32]) -> candle_core::Result<()> {
        let (n, s) = (self.world.size(), self.layout.block(self.world.size()));
        let mut send = mine.to_vec();
        send.resize(s, 0.0);
        let mut all = vec![0f32; n * s];
        self.world.all_gather_f32(&send, &mut all);
        for (param, var) in self.vars.iter().enumerate() {
            let a = self.layout.start(param);
            let values = &all[a..a + self.layout.numel(param)];
            // Straight to the model's device, cast there (a GPU casts 7e9 values in milliseconds).
            let t = Tensor::from_slice(values, self.layout.shape(param), var.device())?;
            var.set(&t.to_dtype(var.dtype())?)?;
        }
        Ok(())
    }
}

/// The optimiser state of a checkpoint, however many ranks wrote it, read by flat ranges.
pub(super) enum Saved {
    /// `optimizer.safetensors`: a tensor per parameter and part of the state.
    Whole(MmapedSafetensors),
    /// Each rank's block, in rank order, with the flat range it covers.
    Shards(Vec<(Range<usize>, MmapedSafetensors)>),
}

impl Saved {
    /// The optimiser state of checkpoint `ck` for parameters laid out as `layout`.
    pub fn open(ck: &Path, layout: &Layout) -> Result<Self, String> {
        let (files, missing) = optimizer_files(ck);
        if !missing.is_empty() {
            return Err(format!("missing {}", missing.join(", ")));
        }
        let map = |f: &str| {
            // SAFETY: checkpoint files are not modified while a run reads them (the run holds the lock).
            unsafe { MmapedSafetensors::new(ck.join(f)) }.map_err(|e| format!("{f}: {e}"))
        };
        if files == [WHOLE_FILE] {
            return Ok(Self::Whole(map(WHOLE_FILE)?));
        }
        let mut shards = Vec::with_capacity(files.len());
        let mut end = 0;
        for f in &files {
            let st = map(f)?;
            let r = st.load(RANGE, &Device::Cpu).and_then(|t| t.to_vec1::<i64>()).map_err(|e| format!("{f}: {e}"))?;
            let [start, stop, total] = r[..] else { return Err(format!("{f}: {RANGE} has {} values, not 3", r.len())) };
            if start as usize != end || total as usize != layout.total || stop < start {
                return Err(format!(
                    "{f} holds the flat values {start}..{stop} of {total}; expected values from {end} of {}",
                    layout.total
                ));
            }
            end = stop as usize;
            shards.push((start as usize..end, st));
        }
        if end != layout.total {
            return Err(format!("the optimizer shards cover {end} of {} values", layout.total));
        }
        Ok(Self::Shards(shards))
    }

    /// The values `range` of the flat state `part` ([`MASTER`], [`EXP_AVG`], [`EXP_AVG_SQ`]): zeros where a
    /// moment was never made (a parameter never updated: the same update follows), None when no moment was.
    pub fn read(&self, layout: &Layout, part: &str, range: Range<usize>) -> Result<Option<Vec<f32>>, String> {
        let mut out = Vec::with_capacity(range.len());
        let mut found = false;
        let mut take = |st: &MmapedSafetensors, name: &str, within: Range<usize>, numel: usize| {
            match st.get(name) {
                Ok(view) => {
                    found = true;
                    out.extend(f32_range(&view, name, within, numel)?);
                }
                Err(_) if part != MASTER => out.resize(out.len() + within.len(), 0.0),
                Err(_) => return Err(format!("no {name}")),
            }
            Ok(())
        };
        match self {
            Self::Whole(st) => {
                for p in layout.pieces(range.clone()) {
                    let name = format!("{part}.{}", layout.names[p.param]);
                    take(st, &name, p.offset..p.offset + p.len, layout.numel(p.param))?;
                }
            }
            Self::Shards(shards) => {
                for (have, st) in shards {
                    let (a, b) = (range.start.max(have.start), range.end.min(have.end));
                    if a < b {
                        take(st, part, a - have.start..b - have.start, have.len())?;
                    }
                }
            }
        }
        Ok((found || range.is_empty()).then_some(out))
    }
}

/// The f32 values `within` of a saved tensor of `numel` values.
fn f32_range(
    view: &safetensors::tensor::TensorView<'_>,
    name: &str,
    within: Range<usize>,
    numel: usize,
) -> Result<Vec<f32>, String> {
    let n: usize = view.shape().iter().product();
    if view.dtype() != safetensors::Dtype::F32 || n != numel {
        return Err(format!("{name} is {:?} {:?}; expected {numel} f32 values", view.dtype(), view.shape()));
    }
    let bytes = &view.data()[within.start * 4..within.end * 4];
    Ok(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
}

/// This rank's block of the state as a shard file's tensors: the parts present, and its flat range.
pub(super) fn shard_tensors(
    parts: Vec<(&str, Vec<Tensor>)>,
    range: Range<usize>,
    total: usize,
) -> candle_core::Result<Vec<(String, Tensor)>> {
    let mut out = Vec::new();
    for (name, pieces) in parts {
        let flat = if pieces.is_empty() {
            Tensor::zeros(0, DType::F32, &Device::Cpu)?
        } else {
            let flat: Vec<Tensor> = pieces.iter().map(|t| t.flatten_all()).collect::<candle_core::Result<_>>()?;
            Tensor::cat(&flat, 0)?.to_device(&Device::Cpu)?
        };
        out.push((name.to_string(), flat));
    }
    let r = [range.start as i64, range.end as i64, total as i64];
    out.push((RANGE.to_string(), Tensor::new(&r[..], &Device::Cpu)?));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Layout {
        Layout::new(&["a".into(), "b".into(), "c".into()], vec![vec![2, 3], vec![4], vec![1, 3]])
    }

    #[test]
    fn blocks_cover_the_flat_vector_once_and_cut_parameters() {
        let l = layout();
        assert_eq!(l.total, 13);
        let ranges: Vec<_> = (0..3).map(|r| l.range(r, 3)).collect();
        assert_eq!(ranges, [0..5, 5..10, 10..13]);
        assert_eq!(l.pieces(0..5), [Piece { param: 0, offset: 0, len: 5 }]);
        assert_eq!(l.pieces(5..10), [Piece { param: 0, offset: 5, len: 1 }, Piece { param: 1, offset: 0, len: 4 }]);
        assert_eq!(l.pieces(10..13), [Piece { param: 2, offset: 0, len: 3 }]);
        // More ranks than values: the last ranks own nothing.
        let tiny = Layout::new(&["x".into()], vec![vec![2]]);
        assert_eq!((0..3).map(|r| tiny.range(r, 3)).collect::<Vec<_>>(), [0..1, 1..2, 2..2]);
        assert!(tiny.pieces(2..2).is_empty());
    }

    fn write(path: &Path, tensors: Vec<(String, Tensor)>) {
        safetensors::serialize_to_file(tensors.iter().map(|(n, t)| (n.as_str(), t)), None, path).unwrap();
    }

    #[test]
    fn whole_and_sharded_states_read_the_same() {
        let l = layout();
        let values: Vec<f32> = (0..13).map(|i| i as f32 * 0.5 - 2.0).collect();
        let whole = tempfile::tempdir().unwrap();
        let mut tensors = Vec::new();
        for p in 0..3 {
            let a = l.start(p);
            let t = Tensor::from_slice(&values[a..a + l.numel(p)], l.shape(p), &Device::Cpu).unwrap();
            tensors.push((format!("master.{}", l.names[p]), t));
        }
        // Only `b` has moments (the others were never updated).
        tensors.push(("exp_avg.b".into(), Tensor::ones(4, DType::F32, &Device::Cpu).unwrap()));
        write(&whole.path().join(WHOLE_FILE), tensors);
        let sharded = tempfile::tempdir().unwrap();
        for r in 0..2 {
            let range = l.range(r, 2);
            let master = Tensor::from_slice(&values[range.clone()], range.len(), &Device::Cpu).unwrap();
            let t = shard_tensors(vec![(MASTER, vec![master])], range, 13).unwrap();
            write(&sharded.path().join(shard_file(r, 2)), t);
        }
        let (w, s) = (Saved::open(whole.path(), &l).unwrap(), Saved::open(sharded.path(), &l).unwrap());
        for range in [0..13, 3..9, 7..8, 12..13] {
            let expect = values[range.clone()].to_vec();
            assert_eq!(w.read(&l, MASTER, range.clone()).unwrap(), Some(expect.clone()));
            assert_eq!(s.read(&l, MASTER, range.clone()).unwrap(), Some(expect));
            assert_eq!(s.read(&l, EXP_AVG, range.clone()).unwrap(), None);
        }
        let m = w.read(&l, EXP_AVG, 4..8).unwrap().unwrap();
        assert_eq!(m, [0.0, 0.0, 1.0, 1.0]);
        assert_eq!(w.read(&l, EXP_AVG_SQ, 0..13).unwrap(), None);
        // A missing shard is named; so is a shard of another model.
        std::fs::remove_file(sharded.path().join(shard_file(1, 2))).unwrap();
        let e = Saved::open(sharded.path(), &l).err().unwrap();
        assert!(e.contains(&shard_file(1, 2)), "{e}");
        let other = Layout::new(&["a".into()], vec![vec![20]]);
        let e = Saved::open(whole.path(), &other).and_then(|s| s.read(&other, MASTER, 0..20)).err().unwrap();
        assert!(e.contains("master.a"), "{e}");
    }
}
