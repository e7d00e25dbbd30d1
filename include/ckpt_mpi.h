/* ckpt_mpi.h — ckpt over MPI: a ckpt_comm made from an MPI communicator.
 *
 * Link with libckpt_mpi (pkg-config ckpt_mpi; CMake ckpt::ckpt_mpi). The
 * core library (ckpt.h) has no MPI dependency; this one is built when MPI
 * is installed.
 *
 *   MPI_Init(&argc, &argv);
 *   ckpt_comm *comm = NULL;
 *   ckpt_comm_mpi(&comm, MPI_COMM_WORLD);
 *   ckpt_project_config cfg = {.project_dir = "runs/x",
 *                              .automatic_checkpoint_naming = true, .comm = comm};
 *   ckpt_accelerator_new(&acc, &cfg);  // saves and loads are collective now
 *   ...
 *   ckpt_accelerator_free(acc);
 *   ckpt_comm_free(comm);
 *   MPI_Finalize();
 *
 * See docs/DISTRIBUTED.md for what each rank writes and how the ranks agree.
 */
#ifndef CKPT_MPI_H
#define CKPT_MPI_H

#include <mpi.h>

#include "ckpt.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Makes *out a ckpt_comm over a duplicate of comm (MPI_Comm_dup: ckpt's
 * messages never mix with the caller's; errors on it are returned, not
 * fatal). rank/size are comm's; local_rank/local_size come from the ranks
 * sharing this node (MPI_Comm_split_type with MPI_COMM_TYPE_SHARED), node
 * and num_nodes number the nodes in the order of their lowest rank. MPI
 * must be initialised; collective over comm. If MPI runs at
 * MPI_THREAD_MULTIPLE (MPI_Init_thread), *out also has exchange_background,
 * on a second duplicate of comm, so that an asynchronous save with
 * node-local tiers replicates in its background thread. Free *out with
 * ckpt_comm_free before MPI_Finalize. CKPT_EIO naming the MPI error on
 * failure. */
CKPT_API int ckpt_comm_mpi(ckpt_comm **out, MPI_Comm comm);

#ifdef __cplusplus
}
#endif

#endif
