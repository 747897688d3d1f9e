//! What the launcher tells a process: its rank, the world size, its rank on its node, and where rank 0
//! listens for the rendezvous, from the variables of Open MPI's mpirun (`OMPI_COMM_WORLD_*`), MPICH/Hydra
//! (`PMI_*`), SLURM's srun (`SLURM_*`) or torchrun (`RANK`, `WORLD_SIZE`, ...).

/// The program that started the processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// Open MPI's mpirun or MPICH's mpiexec: MPI is initialised from its environment.
    Mpirun,
    /// SLURM's srun (MPI too, where SLURM was built with PMI/PMIx support).
    Slurm,
    /// torchrun (or anything that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT).
    Torchrun,
}

impl Launcher {
    /// Whether MPI can be initialised from the launcher's environment.
    pub fn provides_mpi(self) -> bool {
        matches!(self, Launcher::Mpirun | Launcher::Slurm)
    }
}

/// Where rank 0 listens for the other ranks (the TCP rendezvous of the NCCL id).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Master {
    pub addr: String,
    pub port: u16,
}

/// The port rank 0 listens on when the launcher names none (torchrun's default).
pub const DEFAULT_PORT: u16 = 29500;

/// This process's place in the job, as its launcher describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    pub launcher: Launcher,
    pub rank: usize,
    pub size: usize,
    pub local_rank: usize,
    /// MASTER_ADDR:MASTER_PORT (torchrun, or set by hand), else the first node of a SLURM allocation.
    pub master: Option<Master>,
}

/// Why the launcher's variables cannot be used.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum LaunchError {
    #[error("{name} = {value:?} is not a number")]
    NotANumber { name: &'static str, value: String },
    #[error("{rank_name} = {rank} is not below {size_name} = {size}")]
    RankOutOfRange { rank_name: &'static str, rank: usize, size_name: &'static str, size: usize },
}

/// The variables of each launcher: (launcher, rank, world size, local rank), MPI's first (mpirun inside a
/// SLURM allocation numbers the processes itself).
const LAUNCHERS: [(Launcher, &str, &str, &str); 4] = [
    (Launcher::Mpirun, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    (Launcher::Mpirun, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    (Launcher::Slurm, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    (Launcher::Torchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK"),
];

impl Launch {
    /// The launch `var` describes (`var` reads an environment variable), or None for a process started by
    /// hand.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, LaunchError> {
        let num = |name: &'static str| -> Result<Option<usize>, LaunchError> {
            var(name)
                .map(|v| v.trim().parse::<usize>().map_err(|_| LaunchError::NotANumber { name, value: v }))
                .transpose()
        };
        for (launcher, r, s, l) in LAUNCHERS {
            let (Some(rank), Some(size)) = (num(r)?, num(s)?) else { continue };
            if rank >= size {
                return Err(LaunchError::RankOutOfRange { rank_name: r, rank, size_name: s, size });
            }
            let local_rank = num(l)?.unwrap_or(0);
            return Ok(Some(Self { launcher, rank, size, local_rank, master: master(&var)? }));
        }
        Ok(None)
    }
}

/// MASTER_ADDR and MASTER_PORT (the port defaulting to [`DEFAULT_PORT`]); without MASTER_ADDR, the first
/// node of SLURM's allocation.
fn master(var: &impl Fn(&str) -> Option<String>) -> Result<Option<Master>, LaunchError> {
    let port = match var("MASTER_PORT") {
        Some(p) => p.trim().parse::<u16>().map_err(|_| LaunchError::NotANumber { name: "MASTER_PORT", value: p })?,
        None => DEFAULT_PORT,
    };
    let addr = var("MASTER_ADDR").or_else(|| var("SLURM_JOB_NODELIST").and_then(|l| first_node(&l)));
    Ok(addr.map(|addr| Master { addr, port }))
}

/// The first host of a SLURM node list: `gpu-[003-010,012],cpu7` -> `gpu-003`.
pub fn first_node(list: &str) -> Option<String> {
    let list = list.trim();
    let mut depth = 0;
    let end = list
        .char_indices()
        .find(|&(_, c)| {
            match c {
                '[' => depth += 1,
                ']' => depth -= 1,
                _ => {}
            }
            c == ',' && depth == 0
        })
        .map_or(list.len(), |(i, _)| i);
    let first = &list[..end];
    let Some((prefix, rest)) = first.split_once('[') else {
        return (!first.is_empty()).then(|| first.to_string());
    };
    let (ranges, suffix) = rest.split_once(']')?;
    let lowest = ranges.split(',').next()?.split('-').next()?;
    (!lowest.is_empty() && lowest.chars().all(|c| c.is_ascii_digit())).then(|| format!("{prefix}{lowest}{suffix}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn each_launcher_names_rank_size_local_rank_and_master() {
        assert_eq!(Launch::from_vars(env(&[])), Ok(None));
        let torchrun = [
            ("RANK", "5"),
            ("WORLD_SIZE", "16"),
            ("LOCAL_RANK", "5"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29400"),
        ];
        let l = Launch::from_vars(env(&torchrun)).unwrap().unwrap();
        assert_eq!((l.launcher, l.rank, l.size, l.local_rank), (Launcher::Torchrun, 5, 16, 5));
        assert_eq!(l.master, Some(Master { addr: "10.0.0.1".into(), port: 29400 }));
        let srun = [
            ("SLURM_PROCID", "9"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_NODELIST", "gpu-[007-008]"),
        ];
        let l = Launch::from_vars(env(&srun)).unwrap().unwrap();
        assert_eq!((l.launcher, l.rank, l.size, l.local_rank), (Launcher::Slurm, 9, 16, 1));
        assert_eq!(l.master, Some(Master { addr: "gpu-007".into(), port: DEFAULT_PORT }));
        let mpirun =
            [("OMPI_COMM_WORLD_RANK", "3"), ("OMPI_COMM_WORLD_SIZE", "8"), ("OMPI_COMM_WORLD_LOCAL_RANK", "1")];
        let l = Launch::from_vars(env(&mpirun)).unwrap().unwrap();
        assert_eq!((l.launcher, l.rank, l.size, l.local_rank, l.master), (Launcher::Mpirun, 3, 8, 1, None));
        let hydra = [("PMI_RANK", "2"), ("PMI_SIZE", "4")];
        let l = Launch::from_vars(env(&hydra)).unwrap().unwrap();
        assert_eq!((l.launcher, l.rank, l.size, l.local_rank), (Launcher::Mpirun, 2, 4, 0));
        // mpirun inside a SLURM allocation: MPI's own numbering wins, the allocation's node is the master.
        let both = [srun.as_slice(), mpirun.as_slice()].concat();
        let l = Launch::from_vars(env(&both)).unwrap().unwrap();
        assert_eq!((l.launcher, l.rank, l.size), (Launcher::Mpirun, 3, 8));
        assert_eq!(l.master.map(|m| m.addr).as_deref(), Some("gpu-007"));
        assert!(Launcher::Slurm.provides_mpi() && !Launcher::Torchrun.provides_mpi());
    }

    #[test]
    fn bad_values_are_named() {
        let e = Launch::from_vars(env(&[("RANK", "x"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert_eq!(e.to_string(), "RANK = \"x\" is not a number");
        let e = Launch::from_vars(env(&[("RANK", "2"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert_eq!(e.to_string(), "RANK = 2 is not below WORLD_SIZE = 2");
        let bad_port = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "99999")];
        assert!(Launch::from_vars(env(&bad_port)).unwrap_err().to_string().contains("MASTER_PORT"));
    }

    #[test]
    fn the_first_node_of_a_slurm_node_list() {
        for (list, first) in [
            ("node17", Some("node17")),
            ("node17,node18", Some("node17")),
            ("gpu-[003-010,012],cpu7", Some("gpu-003")),
            ("gpu[12,3-4]", Some("gpu12")),
            ("rack[1-2]-n", Some("rack1-n")),
            ("a[x]", None),
            ("", None),
        ] {
            assert_eq!(first_node(list).as_deref(), first, "{list}");
        }
    }
}
